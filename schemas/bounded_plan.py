"""The bounded-shadow plan file (`.rplan`, `target.shadow: {budget_bytes: N}`): chunk plans.

Layout (integers little-endian):

    b"RPLANBND" | u64 index length | index (msgpack) | chunk 0 | chunk 1 | ...

The index is `{"budget": N, "chunks": [[offset, length, blake2b], ...]}` (offsets from the
end of the index); each chunk is a whole ordinary plan file (`schemas/plan.py`: its own
header, digests and, when signed, signature), compiled by `planner/passes/bounded.py`, run
in index order by `executor/bounded.py`. Every target rank of every chunk carries a shadow
section of budget N (`schemas/shadow.py`): the rules the loader and `verify` run on any
plan, plus here: each chunk's budget is the index's, its section has one chunk, and each of
its tensors sits whole inside the buffer at the place `bases` gives it (the rank's tensors
one after another in region order, each at a multiple of `ALIGN`), which is where its
switch ops read. msgpack only.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from .header import PlanFormatError, PlanHeader
from .plan import STAGING, Plan, RankPlan, load_rank_from, open_plan, read_plan_from
from .plan_codec import checksum, pack, read_exact, unpack
from .protocol import ALIGN

MAGIC = b"RPLANBND"
MAX_INDEX = 1 << 24
MAX_CHUNKS = 1 << 16
FIX = "the plan is corrupt or was tampered with: recompile it"


@dataclass(frozen=True, slots=True)
class BoundedIndex:
    budget: int
    chunks: tuple[tuple[int, int, bytes], ...]
    start: int


def is_bounded(path: str) -> bool:
    """Whether the file at `path` starts like a bounded-shadow plan."""
    with open_plan(path) as f:  # a regular file only (a FIFO is refused, never read)
        return f.read(len(MAGIC)) == MAGIC


def encode_bounded(plans: list[Plan], budget: int, key: bytes | None = None) -> bytes:
    from .plan_write import encode_plan

    blobs = [encode_plan(p, key) for p in plans]
    at, index = 0, []
    for b in blobs:
        index.append([at, len(b), checksum(b)])
        at += len(b)
    head = pack({"budget": budget, "chunks": index})
    return MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)


def write_bounded(path: str, plans: list[Plan], budget: int, key: bytes | None = None) -> int:
    data = encode_bounded(plans, budget, key)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def read_index(f: io.BufferedIOBase, path: str) -> BoundedIndex:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise PlanFormatError(f"{path}: not a bounded-shadow plan (no {MAGIC!r} at its start)")
    (n,) = struct.unpack("<Q", read_exact(f, 8, f"{path} index length"))
    if not 0 < n <= MAX_INDEX:
        raise PlanFormatError(f"{path}: bounded index of {n} bytes (at most {MAX_INDEX}); {FIX}")
    raw = unpack(read_exact(f, n, f"{path} bounded index"), f"{path} bounded index")
    if not isinstance(raw, dict) or set(raw) != {"budget", "chunks"}:
        raise PlanFormatError(f"{path}: bounded index is not a map of budget, chunks; {FIX}")
    b, ch = raw["budget"], raw["chunks"]
    if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < 1 << 62:
        raise PlanFormatError(f"{path}: bounded budget = {str(b)[:40]!r}; {FIX}")
    if not isinstance(ch, list) or not 0 < len(ch) <= MAX_CHUNKS:
        raise PlanFormatError(f"{path}: bounded chunks are not a list of 1..{MAX_CHUNKS}; {FIX}")
    chunks, at = [], 0
    for i, c in enumerate(ch):
        ok = (isinstance(c, list) and len(c) == 3 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in c[:2])
            and isinstance(c[2], bytes) and c[0] == at and c[1] > 0)
        if not ok:
            raise PlanFormatError(f"{path}: bounded chunk {i}'s index entry is malformed; {FIX}")
        chunks.append((c[0], c[1], c[2]))
        at += c[1]
    return BoundedIndex(b, tuple(chunks), len(MAGIC) + 8 + n)


def _chunk_file(f: io.BufferedIOBase, idx: BoundedIndex, k: int, path: str) -> io.BytesIO:
    if not 0 <= k < len(idx.chunks):
        raise PlanFormatError(f"{path}: bounded plan has no chunk {k} (it has "
                              f"{len(idx.chunks)})")
    off, n, digest = idx.chunks[k]
    f.seek(idx.start + off)
    return io.BytesIO(read_exact(f, n, f"{path} chunk {k}", digest))


def load_chunk_rank(path: str, k: int, rank: int, key: bytes | None = None
                    ) -> tuple[int, int, PlanHeader, RankPlan]:
    """(budget, chunks, header, rank part) of chunk `k`, checked against the index."""
    with open_plan(path) as f:
        idx = read_index(f, path)
        what = f"{path} chunk {k}"
        header, rp = load_rank_from(_chunk_file(f, idx, k, path), what, rank, key)
    check_chunk_rank(rp, idx.budget, what)
    return idx.budget, len(idx.chunks), header, rp


def load_bounded(path: str, key: bytes | None = None) -> tuple[int, list[Plan]]:
    """The budget and every chunk plan (tools, tests, verify)."""
    with open_plan(path) as f:
        idx = read_index(f, path)
        plans = [read_plan_from(_chunk_file(f, idx, k, path), f"{path} chunk {k}", key)
                 for k in range(len(idx.chunks))]
    for k, p in enumerate(plans):
        for rp in p.ranks:
            check_chunk_rank(rp, idx.budget, f"{path} chunk {k}")
    return idx.budget, plans


def bases(rp: RankPlan) -> list[int]:
    """Each region's offset in the buffer: the tensors one after another, `ALIGN`-aligned
    (staging has no place in it: -1)."""
    out, at = [], 0
    for g in rp.regions:
        if g.name == STAGING:
            out.append(-1)
            continue
        out.append(at)
        at = -(-(at + g.nbytes) // ALIGN) * ALIGN
    return out


def tensor_bases(rp: RankPlan) -> dict[int, int]:
    """Region -> its offset in the buffer, as the switch ops state it (shadow_offset -
    offset, one value per region)."""
    s = rp.shadow.switch if rp.shadow is not None else None
    out: dict[int, int] = {}
    if s is None:
        return out
    for r, o, so in zip(s["region"].tolist(), s["offset"].tolist(),
                        s["shadow_offset"].tolist()):
        if out.setdefault(r, so - o) != so - o:
            raise PlanFormatError(f"rank {rp.rank}: bounded switch ops put region {r} at two "
                                  f"bases; {FIX}")
    return out


def check_chunk_rank(rp: RankPlan, budget: int, what: str) -> None:
    """A chunk's rank part against the file's budget: a target's section is bounded by
    it, in one chunk, each tensor whole inside the buffer, the tensors disjoint."""
    if rp.role != "target":
        if rp.shadow is not None:
            raise PlanFormatError(f"{what}: source rank {rp.rank} carries a shadow; {FIX}")
        return
    sh = rp.shadow
    if sh is None or sh.budget != budget or sh.chunks > 1:
        raise PlanFormatError(f"{what}: target rank {rp.rank} has no bounded section of the "
                              f"file's budget {budget} in one chunk; {FIX}")
    want = bases(rp)
    for r, b in tensor_bases(rp).items():
        if b != want[r]:
            raise PlanFormatError(f"{what}: target rank {rp.rank}: the switch ops read "
                                  f"{rp.regions[r].name} at buffer byte {b}, not {want[r]}; "
                                  f"{FIX}")
    end = max((b + g.nbytes for b, g in zip(want, rp.regions) if b >= 0), default=0)
    if end > budget:
        raise PlanFormatError(f"{what}: target rank {rp.rank}: its tensors take {end} bytes "
                              f"of the buffer, more than the {budget}-byte budget; {FIX}")
