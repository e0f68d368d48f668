"""The chunked plan file (`.rplan`): a chunked shadow's chunk plans (`target.shadow:
{budget_bytes: N}`).

Layout (integers little-endian):

    b"RPLANBND" | u64 index length | index (msgpack) | chunk 0 | chunk 1 | ...

The index is `{"budget": N, "chunks": [[offset, length, blake2b], ...], "targets": [[rank,
tensors, bytes, blake2b], ...], "signature": HMAC}` (offsets from the end of the index);
each chunk is a whole ordinary plan file (`schemas/plan.py`: its own header, digests and,
when signed, signature), compiled by `planner/passes/chunked.py`, run in index order by
`executor/chunked.py`. `targets` states, per target rank, the whole set of tensors the
chunks write together (count, bytes, digest of the sorted names and sizes): a rank's chunks
hold each of them in exactly one chunk (`set_violations`, run by `verify` on every rank and
by the loader on its own). A signed file's index carries `signature` (HMAC-SHA256 of the
index without it, `schemas/integrity.py`), so the chunk count, their order, their digests
and the target sets are the signer's: a dropped, duplicated or reordered chunk is refused
at load with the key. Every target rank of every chunk carries a shadow
section of budget N (`schemas/shadow.py`): the rules the loader and `verify` run on any
plan, plus here: each chunk's budget is the index's, its section has one chunk, and each of
its tensors sits whole inside the buffer at the place `bases` gives it (the rank's tensors
one after another in region order, each at a multiple of `ALIGN`), which is where its
switch ops read. msgpack only.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from .errors import PlanFormatError
from .header import PlanHeader
from .integrity import signature
from .plan import STAGING, Plan, RankPlan, open_plan, read_header, read_plan_from, read_rank
from .plan_codec import checksum, pack, read_exact, unpack
from .protocol import ALIGN

MAGIC = b"RPLANBND"
MAX_INDEX = 1 << 24
MAX_CHUNKS = 1 << 16
FIX = "the plan is corrupt or was tampered with: recompile it"


@dataclass(frozen=True, slots=True)
class ChunkedIndex:
    budget: int
    chunks: tuple[tuple[int, int, bytes], ...]
    start: int
    targets: dict[int, tuple[int, int, bytes]]
    """Target rank -> (tensors, bytes, digest) of the whole set its chunks write."""


def target_set(names: Iterable[tuple[str, int]]) -> tuple[int, int, bytes]:
    """(count, bytes, blake2b of the sorted `name\\0nbytes` lines) of a set of tensors."""
    items = sorted(set(names))
    h = hashlib.blake2b(digest_size=32)
    for n, b in items:
        h.update(f"{n}\0{b}\n".encode())
    return len(items), sum(b for _, b in items), h.digest()


def _rank_tensors(rp: RankPlan) -> list[tuple[str, int]]:
    return [(g.name, g.nbytes) for g in rp.regions if g.name != STAGING]


def set_violations(rank: int, parts: list[RankPlan], want: tuple[int, int, bytes] | None
                   ) -> Iterator[str]:
    """A target rank's chunk parts (in index order) against the index's `targets` entry:
    no tensor in two chunks, and together exactly the stated set (nothing dropped)."""
    seen: dict[str, int] = {}
    for k, rp in enumerate(parts):
        for n, _ in _rank_tensors(rp):
            if n in seen:
                yield (f"chunk {k}: target rank {rank}'s {n} is also in chunk {seen[n]}; a "
                       f"tensor is written by exactly one chunk; {FIX}")
                return
            seen[n] = k
    if want is None:
        yield f"target rank {rank} has no entry in the chunk index's targets; {FIX}"
        return
    got = target_set(t for rp in parts for t in _rank_tensors(rp))
    if got != want:
        yield (f"target rank {rank}: its {len(parts)} chunks hold {got[0]} tensors ({got[1]} "
               f"bytes), the chunk index states {want[0]} ({want[1]} bytes): a chunk was "
               f"dropped, added or changed; {FIX}")


def _signed(index: dict) -> bytes:
    return pack({k: v for k, v in index.items() if k != "signature"})


def is_chunked(path: str) -> bool:
    """Whether the file at `path` starts like a chunked plan."""
    with open_plan(path) as f:  # a regular file only (a FIFO is refused, never read)
        return f.read(len(MAGIC)) == MAGIC


def encode_chunked(plans: list[Plan], budget: int, key: bytes | None = None) -> bytes:
    from .plan_write import encode_plan

    blobs = [encode_plan(p, key) for p in plans]
    at, index = 0, []
    for b in blobs:
        index.append([at, len(b), checksum(b)])
        at += len(b)
    sets: dict[int, set[tuple[str, int]]] = {}
    for p in plans:
        for rp in p.ranks:
            if rp.role == "target":
                sets.setdefault(rp.rank, set()).update(_rank_tensors(rp))
    head_map = {"budget": budget, "chunks": index,
                "targets": [[r, *target_set(v)] for r, v in sorted(sets.items())]}
    if key is not None:
        head_map["signature"] = signature(key, _signed(head_map))
    head = pack(head_map)
    return MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)


def write_chunked(path: str, plans: list[Plan], budget: int, key: bytes | None = None) -> int:
    data = encode_chunked(plans, budget, key)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def read_index(f: io.BufferedIOBase, path: str, key: bytes | None = None) -> ChunkedIndex:
    """The index, checked; with `key`, its signature too (before any chunk is read)."""
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        raise PlanFormatError(f"{path}: not a chunked plan (no {MAGIC!r} at its start)")
    (n,) = struct.unpack("<Q", read_exact(f, 8, f"{path} index length"))
    if not 0 < n <= MAX_INDEX:
        raise PlanFormatError(f"{path}: chunk index of {n} bytes (at most {MAX_INDEX}); {FIX}")
    raw = unpack(read_exact(f, n, f"{path} chunk index"), f"{path} chunk index")
    if not isinstance(raw, dict) or not {"budget", "chunks", "targets"} <= set(raw) <= {
            "budget", "chunks", "targets", "signature"}:
        raise PlanFormatError(f"{path}: chunk index is not a map of budget, chunks, "
                              f"targets (and signature); {FIX}")
    if key is not None:
        sig = raw.get("signature")
        if not sig:
            raise PlanFormatError(f"{path}: the chunked plan's index is not signed, but a plan "
                                  "key was given; compile it with `rdma-plan compile "
                                  "--sign-key FILE`")
        if not isinstance(sig, bytes) or not hmac.compare_digest(
                sig, signature(key, _signed(raw))):
            raise PlanFormatError(f"{path}: the signature does not match the chunked plan's "
                                  "index (chunk count, order, digests, targets): chunks were "
                                  "dropped, duplicated or reordered after signing, or it was "
                                  "signed with another key; recompile and sign it")
    b, ch = raw["budget"], raw["chunks"]
    if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < 1 << 62:
        raise PlanFormatError(f"{path}: chunk budget = {str(b)[:40]!r}; {FIX}")
    if not isinstance(ch, list) or not 0 < len(ch) <= MAX_CHUNKS:
        raise PlanFormatError(f"{path}: chunks are not a list of 1..{MAX_CHUNKS}; {FIX}")
    chunks, at = [], 0
    for i, c in enumerate(ch):
        ok = (isinstance(c, list) and len(c) == 3 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in c[:2])
            and isinstance(c[2], bytes) and c[0] == at and c[1] > 0)
        if not ok:
            raise PlanFormatError(f"{path}: chunk {i}'s index entry is malformed; {FIX}")
        chunks.append((c[0], c[1], c[2]))
        at += c[1]
    tg, targets = raw["targets"], {}
    if not isinstance(tg, list) or len(tg) > MAX_CHUNKS * 16:
        raise PlanFormatError(f"{path}: the index's targets are not a list; {FIX}")
    for i, t in enumerate(tg):
        ok = (isinstance(t, list) and len(t) == 4 and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in t[:3])
            and isinstance(t[3], bytes) and t[0] not in targets)
        if not ok:
            raise PlanFormatError(f"{path}: the index's targets entry {i} is malformed; {FIX}")
        targets[t[0]] = (t[1], t[2], t[3])
    return ChunkedIndex(b, tuple(chunks), len(MAGIC) + 8 + n, targets)


def _chunk_file(f: io.BufferedIOBase, idx: ChunkedIndex, k: int, path: str) -> io.BytesIO:
    if not 0 <= k < len(idx.chunks):
        raise PlanFormatError(f"{path}: chunked plan has no chunk {k} (it has "
                              f"{len(idx.chunks)})")
    off, n, digest = idx.chunks[k]
    f.seek(idx.start + off)
    return io.BytesIO(read_exact(f, n, f"{path} chunk {k}", digest))


def chunk_files(f: BinaryIO, path: str, key: bytes | None = None
                ) -> Iterator[tuple[str, io.BytesIO]]:
    """Each chunk of an open chunked plan file, in index order, as (its name `path chunk k`,
    the ordinary plan file it is, in memory): the index (with `key` its signature) read
    first, each chunk checked against the index's digest."""
    idx = read_index(f, path, key)
    for k in range(len(idx.chunks)):
        yield f"{path} chunk {k}", _chunk_file(f, idx, k, path)


def starts_chunked(f: BinaryIO) -> bool:
    """Whether the open file `f` starts like a chunked plan (it is left at its start)."""
    magic = f.read(len(MAGIC))
    f.seek(0)
    return magic == MAGIC


def plan_header(path: str, key: bytes | None = None) -> PlanHeader:
    """The header of the plan at `path`: an ordinary plan's, a chunked plan's chunk 0's (its
    chunks share the job's ranks and identities: `schemas.tensors.rank_tensors` and the
    loaders hold every chunk's part of a rank to them)."""
    with open_plan(path) as f:
        if not starts_chunked(f):
            return read_header(f, path, key)[0]
        what, chunk = next(chunk_files(f, path, key))
        return read_header(chunk, what, key)[0]


def load_rank_chunks(path: str, rank: int, key: bytes | None = None
                     ) -> tuple[int, list[tuple[PlanHeader, RankPlan]]]:
    """(budget, [(header, rank part)] of every chunk in index order): `read_rank_chunks` of
    the file at `path`."""
    with open_plan(path) as f:
        return read_rank_chunks(f, path, lambda _: rank, key)


def read_rank_chunks(f: BinaryIO, path: str, rank_of: Callable[[PlanHeader], int],
                     key: bytes | None = None
                     ) -> tuple[int, list[tuple[PlanHeader, RankPlan]]]:
    """(budget, [(header, rank part)] of every chunk in index order) of an open chunked
    plan file: the index (with `key` its signature), each chunk against its digest, the
    rank's part of each against the budget, and a target's parts together against the
    index's set (`set_violations`). `rank_of(header)`, called once with chunk 0's header,
    names the rank (an engine derives it from the header); its part is read from every
    chunk."""
    idx = read_index(f, path, key)
    parts: list[tuple[PlanHeader, RankPlan]] = []
    rank = -1
    for k in range(len(idx.chunks)):
        what = f"{path} chunk {k}"
        chunk = _chunk_file(f, idx, k, path)
        header, start = read_header(chunk, what, key)
        if k == 0:
            rank = rank_of(header)
        rp = read_rank(chunk, header, start, rank, what)
        check_chunk_rank(rp, idx.budget, what)
        parts.append((header, rp))
    if len({rp.role for _, rp in parts}) > 1:
        raise PlanFormatError(f"{path}: rank {rank} is a source in some chunks and a target "
                              f"in others; {FIX}")
    if parts and parts[0][1].role == "target":
        for msg in set_violations(rank, [rp for _, rp in parts], idx.targets.get(rank)):
            raise PlanFormatError(f"{path}: {msg}")
    return idx.budget, parts


def load_chunked(path: str, key: bytes | None = None) -> tuple[int, list[Plan]]:
    """The budget and every chunk plan (tools, tests, verify)."""
    return load_chunked_index(path, key)[1:]


def load_chunked_index(path: str, key: bytes | None = None
                       ) -> tuple[ChunkedIndex, int, list[Plan]]:
    """The index, the budget and every chunk plan (verify checks the index's sets)."""
    with open_plan(path) as f:
        idx = read_index(f, path, key)
        plans = [read_plan_from(_chunk_file(f, idx, k, path), f"{path} chunk {k}", key)
                 for k in range(len(idx.chunks))]
    for k, p in enumerate(plans):
        for rp in p.ranks:
            check_chunk_rank(rp, idx.budget, f"{path} chunk {k}")
    return idx, idx.budget, plans


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
            raise PlanFormatError(f"rank {rp.rank}: chunked switch ops put region {r} at two "
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
        raise PlanFormatError(f"{what}: target rank {rp.rank} has no chunked section of the "
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
