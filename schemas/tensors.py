"""What each plan rank binds: its tensors and the pieces of logical tensors each holds.

The compiler stores one blob per rank, `tensors/<rank>` (msgpack map):

    {"names":  [logical tensor names this rank's pieces refer to],
     "shapes": [their logical shapes],
     "buffer": bytes, one per region (1: a module buffer such as `router.expert_bias`,
               0: a parameter; the staging region, if any, is last and never listed),
     "pieces": PIECE_COLUMNS as raw little-endian columns}

or `{"same_as": r}`: identical to the blob of an earlier rank `r` (replicas share theirs).
A piece puts elements `[off0, off0+size0) x [off1, off1+size1)` of logical tensor
`names[tensor]` (a 1-d tensor has `off1 = 0, size1 = 1`) at flat element
`start + i0*stride0 + i1*stride1` of region `region` (row-major, element units), i.e.
`tensor.view(-1).as_strided((size0, size1), (stride0, stride1), start)`.

`rank_tensors(path, rank)` reads the header and that rank's blobs only (of a chunked plan,
`schemas/chunked_plan.py`, every chunk's: the union of what the rank binds in each); it is
what `rdma-plan tensors` prints and what `integrations/` match live models against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chunked_plan import chunk_files, starts_chunked
from .errors import PlanFormatError
from .identity import plan_identity
from .plan import STAGING, RankPlan, Table, open_plan, plan_int, read_blob, read_header

PIECE_COLUMNS = (("region", "<i4"), ("tensor", "<i4"), ("off0", "<i8"), ("off1", "<i8"),
                 ("size0", "<i8"), ("size1", "<i8"), ("start", "<i8"), ("stride0", "<i8"),
                 ("stride1", "<i8"))
"""One piece of a logical tensor inside a region (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Piece:
    tensor: str
    """Logical (HF checkpoint) tensor name."""
    offsets: tuple[int, ...]
    """Start of the box in the logical tensor, one entry per logical dim."""
    sizes: tuple[int, ...]
    """Extent of the box, one entry per logical dim."""
    start: int
    """Flat element offset of the box's first element in the bound tensor."""
    strides: tuple[int, ...]
    """Element stride in the bound tensor of each logical dim."""


@dataclass(frozen=True, slots=True)
class BoundTensor:
    name: str
    """Native name, as the framework's `named_parameters()`/`named_buffers()` gives it."""
    shape: tuple[int, ...]
    dtype: str
    buffer: bool
    """A module buffer (trained state that moves), not a parameter."""
    region: int
    """Region index in the rank's plan (a chunked plan's: its place in the union)."""
    pieces: tuple[Piece, ...]
    """The logical boxes it holds; elements outside them are padding."""


@dataclass(frozen=True, slots=True)
class RankTensors:
    rank: int
    role: str
    """`source` or `target`."""
    identity: dict[str, int | str] | None
    """The rank's coordinates (`schemas/identity.py`); None in plans without identities."""
    tensors: tuple[BoundTensor, ...]
    """Everything `executor.load(tensors=...)` must be given for this rank, in plan order."""

    def json(self) -> dict[str, Any]:
        return {"rank": self.rank, "role": self.role, "identity": self.identity,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                             "kind": "buffer" if t.buffer else "parameter",
                             "pieces": [{"tensor": p.tensor, "offsets": list(p.offsets),
                                         "sizes": list(p.sizes), "start": p.start,
                                         "strides": list(p.strides)} for p in t.pieces]}
                            for t in self.tensors]}


def encode_rank_tensors(pieces: dict[str, np.ndarray], buffer: np.ndarray,
                        names: list[str], shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """One rank's blob: `pieces` columns (`tensor` indexes `names`), a flag per region."""
    table = Table.build(PIECE_COLUMNS, **pieces)
    return {"names": list(names), "shapes": list(shapes),  # tuples pack as msgpack arrays
            "buffer": np.asarray(buffer, dtype=np.uint8).tobytes(),
            "pieces": table.to_msgpack()}


def _blob(f: Any, header: Any, start: int, rank: int, path: str) -> dict:
    raw = read_blob(f, header, start, f"tensors/{rank}", path)
    if isinstance(raw, dict) and "same_as" in raw:
        other = raw["same_as"]
        if not isinstance(other, int) or not 0 <= other < rank:
            raise PlanFormatError(f"{path}: tensors/{rank} refers to rank {other!r}; corrupt")
        raw = read_blob(f, header, start, f"tensors/{other}", path)
    if not isinstance(raw, dict) or "same_as" in raw:
        raise PlanFormatError(f"{path}: blob tensors/{rank} is malformed; recompile the plan")
    return raw


def rank_tensors(path: str, rank: int) -> RankTensors:
    """The tensors rank `rank` of the plan at `path` binds, with their pieces; of a chunked
    plan, every tensor the rank binds in any chunk (`merge_chunks`)."""
    with open_plan(path) as f:
        if not starts_chunked(f):
            return read_rank_tensors(f, rank, path)
        parts = [read_rank_tensors(chunk, rank, what) for what, chunk in chunk_files(f, path)]
    return merge_chunks(parts, path)


def read_rank_tensors(f: Any, rank: int, path: str) -> RankTensors:
    """`rank_tensors` of an open ordinary plan file."""
    header, start = read_header(f, path)
    if f"rank/{rank}" not in header.blobs:
        raise PlanFormatError(f"{path}: plan has no rank {rank} (it has "
                              f"{header.world} ranks)")
    if f"tensors/{rank}" not in header.blobs:
        raise PlanFormatError(f"{path}: the plan does not list its ranks' tensors (compiled "
                              "by an older rdma-plan); recompile it")
    rp = RankPlan.decode(read_blob(f, header, start, f"rank/{rank}", path))
    raw = _blob(f, header, start, rank, path)
    return RankTensors(rank=rank, role=rp.role, identity=plan_identity(header, rank, path),
                       tensors=_decode(raw, rp, path))


def merge_chunks(parts: list[RankTensors], path: str) -> RankTensors:
    """One rank's tensors over every chunk of a chunked plan, in order of first use: each
    chunk must record the rank's role and identity as chunk 0 does, and a tensor bound in
    several chunks the same name, shape, dtype and kind (its pieces are their union)."""
    first = parts[0]
    seen: dict[str, BoundTensor] = {}
    for k, rt in enumerate(parts):
        if rt.role != first.role or rt.identity != first.identity:
            raise PlanFormatError(
                f"{path}: chunk {k} records rank {rt.rank} as {rt.role} {rt.identity}, chunk "
                f"0 as {first.role} {first.identity}: the chunks were compiled for different "
                "jobs; recompile the plan")
        for t in rt.tensors:
            had = seen.get(t.name)
            if had is None:
                seen[t.name] = t
                continue
            if (had.shape, had.dtype, had.buffer) != (t.shape, t.dtype, t.buffer):
                raise PlanFormatError(
                    f"{path}: chunk {k} binds rank {rt.rank}'s {t.name} as {t.dtype} "
                    f"{list(t.shape)}, an earlier chunk as {had.dtype} {list(had.shape)}; "
                    "recompile the plan")
            pieces = had.pieces + tuple(p for p in t.pieces if p not in had.pieces)
            seen[t.name] = dataclasses.replace(had, pieces=pieces)
    tensors = tuple(dataclasses.replace(t, region=i) for i, t in enumerate(seen.values()))
    return RankTensors(rank=first.rank, role=first.role, identity=first.identity,
                       tensors=tensors)


def holders(path: str, tensor: str) -> list[int]:
    """The source ranks whose tensors hold a piece of logical tensor `tensor`: each source's
    blob read once (a blob shared through `same_as` decoded once), its piece table's `tensor`
    column compared as a column (no piece built)."""
    out: list[int] = []
    seen: dict[int, bool] = {}
    with open_plan(path) as f:
        header, start = read_header(f, path)
        for r in range(header.sources):
            raw = read_blob(f, header, start, f"tensors/{r}", path)
            other = raw.get("same_as") if isinstance(raw, dict) else None
            if isinstance(other, int) and not isinstance(other, bool) and other in seen:
                hit = seen[other]
            else:
                hit = _holds(_blob(f, header, start, r, path), tensor, f"{path} tensors/{r}")
            seen[r] = hit
            if hit:
                out.append(r)
    return out


def _holds(raw: dict, tensor: str, what: str) -> bool:
    try:
        names = raw["names"]
        table = Table.from_msgpack(PIECE_COLUMNS, raw["pieces"], what)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError("names is not a list of strings")
    except (KeyError, TypeError) as e:
        raise PlanFormatError(f"{what}: malformed ({type(e).__name__}: {e})") from None
    col = table["tensor"]
    if len(col) and not 0 <= int(col.min()) <= int(col.max()) < len(names):
        raise PlanFormatError(f"{what}: a piece names tensor {int(col.max())} of {len(names)};"
                              " corrupt")
    return tensor in names and bool((col == names.index(tensor)).any())


def _decode(raw: dict, rp: RankPlan, path: str) -> tuple[BoundTensor, ...]:
    what = f"{path} tensors/{rp.rank}"
    try:
        names = [str(n) for n in raw["names"]]
        shapes = [tuple(plan_int(x) for x in s) for s in raw["shapes"]]
        flags = np.frombuffer(raw["buffer"], dtype=np.uint8)
        table = Table.from_msgpack(PIECE_COLUMNS, raw["pieces"], what)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise PlanFormatError(f"{what}: malformed ({type(e).__name__}: {e})") from None
    regions = [r for r in rp.regions if r.name != STAGING]
    if len(flags) != len(regions) or len(names) != len(shapes):
        raise PlanFormatError(f"{what}: {len(flags)} flags for {len(regions)} regions; corrupt")
    cols = {n: table[n].tolist() for n, _ in PIECE_COLUMNS}
    by_region: list[list[Piece]] = [[] for _ in regions]
    for i in range(len(table)):
        reg, t = cols["region"][i], cols["tensor"][i]
        if not (0 <= reg < len(regions) and 0 <= t < len(names)):
            raise PlanFormatError(f"{what}: piece {i} names region {reg} / tensor {t}; corrupt")
        nd = len(shapes[t])
        by_region[reg].append(Piece(
            names[t], (cols["off0"][i], cols["off1"][i])[:nd],
            (cols["size0"][i], cols["size1"][i])[:nd], cols["start"][i],
            (cols["stride0"][i], cols["stride1"][i])[:nd]))
    for reg, ps in enumerate(by_region):
        n = math.prod(regions[reg].shape)
        for p in ps:
            last = p.start + sum((s - 1) * st for s, st in zip(p.sizes, p.strides))
            if p.start < 0 or last >= n or min(p.sizes, default=1) < 1:
                raise PlanFormatError(f"{what}: a piece of {p.tensor} lies outside "
                                      f"{regions[reg].name} {regions[reg].shape}; corrupt")
    return tuple(BoundTensor(r.name, r.shape, r.dtype, bool(flags[i]), i, tuple(by_region[i]))
                 for i, r in enumerate(regions))
