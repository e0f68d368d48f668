"""Rank facts for the people and programs that bind a plan: identities and tensors.

Two things the compiler knows and stores (readers never re-derive them):
- `identities` (header key, `schemas/identity.py`): every plan rank's coordinates in its
  framework's terms, from each framework's `identity(cfg, rank)` (`planner/frameworks.py`);
- `tensors/<rank>` blobs (`schemas/tensors.py`): the tensors each rank binds and the pieces
  of logical tensors they hold, from the piece tables the compiler already built.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import tempfile
from typing import Any

import numpy as np

from planner.frameworks import FRAMEWORKS
from planner.layouts.base import Layout
from planner.passes.intersect import PieceTable
from planner.spec import ModelSpec
from schemas.config import Config
from schemas.identity import HEADER_KEY
from schemas.tensors import encode_rank_tensors


def rank_identities(cfg: Config, src: Layout, dst: Layout) -> dict[str, Any]:
    """`{"identities": [...]}` (one per plan rank) when both layouts are the ones `cfg`
    describes; `{}` for hand-built layouts (tests), which have no framework coordinates."""
    out = []
    for layout, side, name in ((src, cfg.source, cfg.source.framework),
                               (dst, cfg.target, cfg.target.engine)):
        fw = FRAMEWORKS.get(layout.framework)
        if fw is None or layout.framework != name or layout.world != side.world:
            return {}
        out += [fw.identity(side, r) for r in range(layout.world)]
    return {HEADER_KEY: out}


def rank_tensor_blobs(spec: ModelSpec, tables: tuple[PieceTable, PieceTable],
                      layouts: tuple[Layout, Layout], spill: bool = False
                      ) -> tuple[tuple[str, Any], ...]:
    """A `tensors/<rank>` blob per plan rank (replicas point at their first copy), from the
    source and target piece tables and layouts: the compiler takes them while it still
    holds the tables and adds them to the plan at the end. Blobs of equal content (equal
    msgpack bytes) are found by `_content`.

    `spill`: each blob's piece columns written to an unnamed temporary file as it is made
    and given back as read-only memoryviews of it mapped (`_Spill`): msgpack packs them as
    the same bytes, held in the page cache instead of this process until the plan is
    written (a large model's blobs are hundreds of MB)."""
    blobs: list[tuple[str, Any]] = []
    first: dict[tuple, int] = {}
    out = _Spill() if spill else None
    for table, layout, base in zip(tables, layouts, (0, layouts[0].world)):
        cut = np.searchsorted(table.rank, np.arange(base, base + layout.world + 1))
        alike: dict[int, list[tuple[slice, int]]] = {}  # by tensor list: (rows, first rank)
        for rl in layout.ranks:
            r, rows = base + rl.rank, slice(cut[rl.rank], cut[rl.rank + 1])
            seen = alike.setdefault(id(rl.tensors), [])
            same = next((f for other, f in seen if _same_rows(table, rows, other)), None)
            if same is None:  # equal content: point at the first
                blob = _blob(spec, table, rows, rl.tensors)
                same = first.setdefault(_content(blob), r)
                seen.append((rows, same))
                if same == r and out is not None:
                    out.add(blob)
            blobs.append((f"tensors/{r}", blob if same == r else {"same_as": same}))
    if out is not None:
        out.close()
    return tuple(blobs)


def _content(blob: dict[str, Any]) -> tuple:
    """What a `tensors/<rank>` blob's msgpack bytes are made of, as a key: two blobs' keys are
    equal where their bytes are (but by a collision): every value by value (a list as a
    tuple of its items, each shape as a tuple: names are strings, shapes sequences of
    integers), but the piece columns by the blake2b-256 of their bytes, each column's
    length first. Not the digest of the blob packed: its thousands of names would be packed
    twice, here and when the plan is written."""
    h = hashlib.blake2b(digest_size=32)
    for col in blob["pieces"]:
        h.update(struct.pack("<Q", len(col)))
        h.update(col)
    return tuple((k, h.digest() if k == "pieces" else tuple(map(tuple, v)) if k == "shapes"
                  else tuple(v) if isinstance(v, list) else v) for k, v in blob.items())


class _Spill:
    """Blobs' `pieces` columns (bytes) written to one unnamed temporary file as they come
    (`add`), then, at `close`, each blob's columns replaced by memoryviews of the file
    mapped read-only (the mapping outlives the file)."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        self.size = 0
        self.blobs: list[tuple[dict[str, Any], list[int]]] = []

    def add(self, blob: dict[str, Any]) -> None:
        lengths = []
        for col in blob["pieces"]:
            self.file.write(col)
            lengths.append(len(col))
        self.size += sum(lengths)
        blob["pieces"] = None  # (set again at `close`)
        self.blobs.append((blob, lengths))

    def close(self) -> None:
        with self.file as f:
            f.flush()
            m = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_READ) if self.size \
                else b""
        view, at = memoryview(m), 0
        for blob, lengths in self.blobs:
            cols = []
            for n in lengths:
                cols.append(view[at:at + n])
                at += n
            blob["pieces"] = cols
        self.blobs.clear()


_BLOB_COLUMNS = ("region", "tensor", "off0", "off1", "size0", "size1", "base", "a0", "a1")
"""The piece table's columns a `tensors/<rank>` blob is made of (with the rank's tensors)."""


def _same_rows(t: PieceTable, a: slice, b: slice) -> bool:
    """Whether rows `a` and `b` of `t` make the same blob (for ranks of one tensor list):
    a replica's blob is found equal without being built."""
    return a.stop - a.start == b.stop - b.start and all(
        np.array_equal(getattr(t, c)[a], getattr(t, c)[b]) for c in _BLOB_COLUMNS)


def _blob(spec: ModelSpec, t: PieceTable, rows: slice, tensors: tuple) -> dict[str, Any]:
    ids, local = np.unique(t.tensor[rows], return_inverse=True)
    start = t.base[rows] + t.off0[rows] * t.a0[rows] + t.off1[rows] * t.a1[rows]
    cols = {"region": t.region[rows], "tensor": local.reshape(-1), "off0": t.off0[rows],
            "off1": t.off1[rows], "size0": t.size0[rows], "size1": t.size1[rows],
            "start": start, "stride0": t.a0[rows], "stride1": t.a1[rows]}
    logical = [spec.tensors[i] for i in ids.tolist()]
    return encode_rank_tensors(cols, np.array([pt.buffer for pt in tensors], dtype=np.uint8),
                               [x.name for x in logical], [x.shape for x in logical])
