"""The plan file (`.rplan`): what every rank does, decided once by the compiler.

Layout of the file (all integers little-endian):

    b"RDMAPLAN" | u32 format version | u64 header length | header (msgpack)
    | 32-byte blake2b of the header | blobs...

The header (`schemas/header.py`, `PlanHeader`) holds the fingerprint, options, stats, the
topology summary, an index `blobs: {name: [offset, length, blake2b]}` and, when the plan is
signed, its `signature` (`schemas/integrity.py`); each blob is one msgpack object: `rank/<r>`
for every rank (its `RankPlan`), and `explain` (per logical tensor: who feeds whom). A
rank reads the header and its own blob only. Columnar arrays travel as raw little-endian
bytes. msgpack only: loading a plan can never run code.

A blob is stored compact (`schemas/plan_codec.py`: `FRAME`, its decoded size, a raw deflate
stream of its msgpack bytes; the default) or plain (its msgpack bytes); a table's integer
column is stored narrower where it can (`schemas/table.py`; every row stored, so a table
decodes to at most 8x its stored bytes). The
index's length and digest are those of the stored bytes, so the digests peers compare and
the signature cover the compact form; a rank inflates its own blob only, its decoded size
bounded by its stored size before anything is decoded.

What a rank does with its part, stage by stage, and every rule about it: `schemas/protocol.py`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, BinaryIO

import numpy as np

from .errors import PlanFormatError
from .header import MAX_STAGES, MAX_WORLD, PlanHeader
from .plan_codec import MAX_HEADER_BYTES, check_plain, checksum, inflate, read_exact, unpack
from .shadow_part import ShadowPart
from .table import Table

MAGIC = b"RDMAPLAN"
FORMAT_VERSION = 4
"""2: the typed header (`PlanHeader`), per-rank digests compared at connect, signing.
3: blobs may be compact (zlib, `schemas/plan_codec.py`).
4: compact blobs are raw deflate streams; a table's integer column may be stored narrower
(`schemas/table.py`)."""
READ_VERSIONS = (2, 3, 4)
"""Versions this build reads: a version 2 file is a version 3 file whose blobs are all plain,
a version 3 file a version 4 file whose columns are all raw and whose compact blobs are zlib
streams."""
STAGING = "__staging__"
"""Name of the staging region; when present it is the last region of a rank."""

WRITE, PACK, UNPACK, QUANT = 0, 1, 2, 3
"""Op kinds: the closed set the executor interprets. QUANT runs with the packs (step 2):
it reads a 2-d box (`size0` x `size1`, any float dtype) and writes its e4m3 values at
`dst_offset` in rows of `size1`, `dst_stride0` apart, and its float32 block scales
(`[ceil(size0/128), ceil(size1/128)]`, amax/448 per 128x128 block) at `aux_offset`
(float32 elements) of the same destination region, in rows `ceil(dst_stride0/128)` apart:
where a QUANT of the whole row-major box `dst_stride0` wide would put them
(`schemas.protocol.quant_scales`)."""
DONE, ACK, READY, SLOT_ACK = 0, 1, 2, 3
"""Signal kinds: DONE (writes of a stage landed), ACK (staging of a stage is free again),
READY (a target may be written: sent once per step, before any write into it), SLOT_ACK
(an ACK awaited `schemas.protocol.SLOTS` stages later: staging used in slots, where stage s
writes only the slot stage s - SLOTS freed, so the writer does not wait for stages between)."""

DTYPE_CODES = ("uint8", "bfloat16", "float16", "float32", "float8_e4m3fn")
"""dtype codes used in copy ops (index = code)."""
ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}

WRITE_COLUMNS = (("dst_rank", "<i4"), ("src_region", "<i4"), ("src_offset", "<i8"),
                 ("dst_region", "<i4"), ("dst_offset", "<i8"), ("nbytes", "<i8"))
"""One write: `nbytes` contiguous bytes from this rank's region to a peer's region.
Offsets are in bytes."""
BATCH_COLUMNS = (("stage", "<i4"), ("nic", "<i4"), ("start", "<i8"), ("stop", "<i8"))
"""Writes `[start, stop)` are one batch posted together on local NIC `nic` in `stage`."""
COPY_COLUMNS = (("kind", "<u1"), ("stage", "<i4"),
                ("src_region", "<i4"), ("src_dtype", "<u1"), ("src_offset", "<i8"),
                ("src_stride0", "<i8"), ("src_stride1", "<i8"), ("src_stride2", "<i8"),
                ("dst_region", "<i4"), ("dst_dtype", "<u1"), ("dst_offset", "<i8"),
                ("dst_stride0", "<i8"), ("dst_stride1", "<i8"), ("dst_stride2", "<i8"),
                ("size0", "<i8"), ("size1", "<i8"), ("size2", "<i8"), ("aux_offset", "<i8"))
"""A local strided copy of a 3-d box (`size0..2`), with a cast where dtypes differ.
Offsets and strides count elements of that side's dtype (`DTYPE_CODES`). `aux_offset`
is used by QUANT only (0 otherwise)."""
COPY_GROUP_KEY = ("src_region", "src_dtype", "src_stride0", "src_stride1", "src_stride2",
                  "dst_region", "dst_dtype", "dst_stride0", "dst_stride1", "dst_stride2",
                  "size0", "size1", "size2")
"""PACK (or UNPACK) copies of one stage that agree on these columns (all but their offsets)
run as one vectorised op in the executor (`executor/copies.py`); a QUANT is one op."""
SIGNAL_COLUMNS = (("stage", "<i4"), ("peer", "<i4"), ("kind", "<u1"))
"""A notification sent (`signals`) or awaited (`waits`) in a stage."""
EXPLAIN_COLUMNS = (("tensor", "<i4"), ("src_rank", "<i4"), ("src_region", "<i4"),
                   ("dst_rank", "<i4"), ("dst_region", "<i4"), ("nbytes", "<i8"),
                   ("boxes", "<i8"))
"""Per logical tensor: bytes (in target dtype) that a source region feeds a target region."""
DAG_NODE_COLUMNS = (("rank", "<i4"), ("stage", "<i4"), ("phase", "<u1"))
"""A node of the stage DAG: one phase (ready, pack, write, done, unpack, ack) of one stage
of one rank."""
COVERAGE_COLUMNS = (("rank", "<i4"), ("region", "<i4"), ("nbytes", "<i8"))
"""Bytes of a target region that hold logical data (the rest is padding)."""
DAG_EDGE_COLUMNS = (("u", "<i8"), ("v", "<i8"))
"""An edge of the stage DAG: node `u` happens before node `v`."""


def plan_int(x: Any) -> int:
    """A plan integer: a msgpack int (not a float, not a bool) within +-2**62."""
    if isinstance(x, bool) or not isinstance(x, int) or not -(1 << 62) <= x <= 1 << 62:
        raise ValueError(f"{str(x)[:40]!r} is not an integer in range")
    return x


def _ints_in_range(flat: list[Any], what: Any) -> None:
    """Every item a plan integer (`plan_int`), by C-level passes over the list."""
    if set(map(type, flat)) - {int} or flat and not -(1 << 62) <= min(flat) <= max(flat) <= 1 << 62:
        raise ValueError(f"{str(what)[:40]!r} holds a value that is not an integer in range")


def _lists(s: Any, n: int | None = None) -> None:
    """`s` a list of lists (each of `n` items, where given)."""
    if not isinstance(s, list) or set(map(type, s)) - {list} or \
            n is not None and set(map(len, s)) - {n}:
        raise ValueError(f"{str(s)[:40]!r} is not a list of {n or ''} lists")


_SEEN_REGIONS: list[tuple[list[Any], tuple[Region, ...]]] = []
"""The last few distinct region lists decoded (as read) and their regions: most parts of a
large plan list the same regions as another part (every FSDP shard, every replica), and a
tool reads hundreds of parts; an equal list, checked as below, is the same regions."""
SEEN_REGIONS = 4


def _regions(raw: Any) -> tuple[Region, ...]:
    """The regions of a part, `[name, dtype, shape, nbytes]` each, checked a column at a
    time (a part of a large model lists thousands); a list equal to one decoded lately
    gives that one's regions. Equal to a list that passed the checks below, a list holds
    the same strings and the same numbers in the same lists (a msgpack string, list or map
    equals only its own kind), so of its checks only the numbers' type is left (an int
    equals a float or a bool of its value): that one is made first, the rest are not."""
    if isinstance(raw, list):
        for seen, regions in _SEEN_REGIONS:
            if seen == raw:
                _, _, shapes, nbytes = zip(*raw)
                if not set(map(type, chain.from_iterable(shapes))) - {int} \
                        and not set(map(type, nbytes)) - {int}:
                    return regions
                break  # a float or a bool where an int was: the checks below say so
    _lists(raw, 4)
    if not raw:
        return ()
    names, dtypes, shapes, nbytes = zip(*raw)
    _lists(list(shapes))
    _ints_in_range([*chain.from_iterable(shapes), *nbytes], raw)
    strings = not set(map(type, names + dtypes)) - {str}
    regions = tuple(map(Region, map(str, names), map(str, dtypes), map(tuple, shapes), nbytes))
    if strings:
        _SEEN_REGIONS[:] = [(raw, regions), *_SEEN_REGIONS[:SEEN_REGIONS - 1]]
    return regions


_SEEN_PEERS: list[tuple[list[Any], tuple[tuple[int, tuple[tuple[int, int], ...]], ...]]] = []
"""The last few distinct `peer_regions` lists decoded (as read) and their tuples: every
source of one model's copy lists the same peers and regions."""


def _peer_regions(raw: Any) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """`[[peer, [[region, nbytes], ...]], ...]`, checked a column at a time; a list equal
    to one decoded lately gives that one's tuples once its numbers are ints (what equality
    leaves open, as in `_regions`)."""
    if isinstance(raw, list):
        for seen, got in _SEEN_PEERS:
            if seen == raw:
                peers, pairs = zip(*raw) if raw else ((), ())
                if not set(map(type, peers)) - {int} and not set(
                        map(type, chain.from_iterable(chain.from_iterable(pairs)))) - {int}:
                    return got
                break  # a float or a bool where an int was: the checks below say so
    _lists(raw, 2)
    if not raw:
        return ()
    peers, pairs = zip(*raw)
    _lists(list(pairs))
    inner = list(chain.from_iterable(pairs))
    _lists(inner, 2)
    _ints_in_range([*peers, *chain.from_iterable(inner)], raw)
    got = tuple(zip(peers, (tuple(map(tuple, s)) for s in pairs)))
    _SEEN_PEERS[:] = [(raw, got), *_SEEN_PEERS[:SEEN_REGIONS - 1]]
    return got


def _part_identity(raw: Any) -> dict[str, Any] | None:
    """A part's recorded identity, as a plain map (checked where it is compared)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"identity {str(raw)[:40]!r} is not a map")
    return dict(raw)


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    """Native tensor name, or `STAGING`."""
    dtype: str
    """Element dtype (`uint8` for staging)."""
    shape: tuple[int, ...]
    """Shape the bound tensor must have."""
    nbytes: int
    """Size in bytes; every op must stay inside it."""


@dataclass(frozen=True, slots=True)
class RegionFacts:
    """What the checks read of a rank's regions, as columns (`region_facts`)."""

    names: tuple[str, ...]
    nbytes: np.ndarray
    """Each region's bytes (int64, read-only), then a 0 (an index past the last reads 0)."""
    codes: np.ndarray
    """Each region's dtype code (`DTYPE_CODES`; -1: another dtype), then -1."""


_FACTS: list[tuple[tuple[Region, ...], RegionFacts]] = []


def region_facts(regions: tuple[Region, ...]) -> RegionFacts:
    """`regions` as columns; the same tuple (many parts decode to one: `_regions`) is read
    once (the last few are kept, by identity: a tuple of frozen regions never changes)."""
    for seen, facts in _FACTS:
        if seen is regions:
            return facts
    code = {d: i for i, d in enumerate(DTYPE_CODES)}
    nbytes = np.array([r.nbytes for r in regions] + [0], dtype=np.int64)
    codes = np.array([code.get(r.dtype, -1) for r in regions] + [-1], dtype=np.int64)
    nbytes.flags.writeable = codes.flags.writeable = False
    facts = RegionFacts(tuple(r.name for r in regions), nbytes, codes)
    _FACTS[:] = [(regions, facts), *_FACTS[:SEEN_REGIONS - 1]]
    return facts



def region_row(r: Region) -> list[Any]:
    """A region as a part lists it: name, dtype, shape, bytes."""
    return [r.name, r.dtype, list(r.shape), r.nbytes]

@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    """Plan rank: sources are 0..S-1, targets S..S+T-1."""
    role: str
    """`source` or `target`."""
    host: int
    """Host index in the cluster."""
    gpu: int
    """GPU index within the host."""
    nics: tuple[str, ...]
    """Names of the local NICs `batches.nic` refers to."""
    regions: tuple[Region, ...]
    """Memory this rank registers once: its physical tensors, then staging if any."""
    writes: Table
    """Writes this rank issues, ordered by stage and batch (`WRITE_COLUMNS`)."""
    batches: Table
    """Batches over `writes` (`BATCH_COLUMNS`)."""
    copies: Table
    """Packs (sources) and unpacks (targets) (`COPY_COLUMNS`)."""
    signals: Table
    """Signals this rank sends (`SIGNAL_COLUMNS`)."""
    waits: Table
    """Signals this rank waits for (`SIGNAL_COLUMNS`)."""
    peer_regions: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    """For each peer this rank writes to: (region id, byte size) of every region of that
    peer it writes into (only those: a rank need not know the rest of a peer)."""
    stages: int
    """Number of stages (every rank walks all of them)."""
    identity: dict[str, Any] | None = None
    """The rank's identity (`schemas/identity.py`) inside its own part, covered by the part's
    digest: a part moved to another rank's slot is refused (`identity.check_part`). None in
    plans written before it was recorded (and plans without identities)."""

    shadow: ShadowPart | None = None
    """A target's shadow section (`schemas/shadow.py`), only in plans compiled with
    `target.shadow`; absent (no key in the part) otherwise."""

    def encode(self, regions: Any = None, lists: bool = True) -> dict[str, Any]:
        """The part as msgpack packs it. `regions`: what stands for the regions list, when
        the caller has it already (`plan_write`: the list's msgpack bytes). `lists`: the
        peer regions as lists (as decoded), else as the tuples held (`plan_write`: msgpack
        packs a tuple as the same array, without the copy)."""
        extra = {} if self.identity is None else {"identity": dict(self.identity)}
        if self.shadow is not None:
            extra["shadow"] = self.shadow.encode()
        return {
            "rank": self.rank, "role": self.role, "host": self.host, "gpu": self.gpu,
            "nics": list(self.nics),
            "regions": [region_row(r) for r in self.regions] if regions is None else regions,
            "writes": self.writes.views(), "batches": self.batches.views(),
            "copies": self.copies.views(), "signals": self.signals.views(),
            "waits": self.waits.views(),
            "peer_regions": [[p, [list(rs) for rs in s]] for p, s in self.peer_regions]
            if lists else self.peer_regions,
            "stages": self.stages, **extra,
        }

    @staticmethod
    def decode(raw: Any) -> RankPlan:
        try:
            what = f"rank/{raw['rank']}"
            regions = _regions(raw["regions"])
            return RankPlan(
                rank=plan_int(raw["rank"]), role=str(raw["role"]), host=plan_int(raw["host"]),
                gpu=plan_int(raw["gpu"]), nics=tuple(str(n) for n in raw["nics"]),
                regions=regions,
                writes=Table.from_msgpack(WRITE_COLUMNS, raw["writes"], what + ".writes"),
                batches=Table.from_msgpack(BATCH_COLUMNS, raw["batches"], what + ".batches"),
                copies=Table.from_msgpack(COPY_COLUMNS, raw["copies"], what + ".copies"),
                signals=Table.from_msgpack(SIGNAL_COLUMNS, raw["signals"], what + ".signals"),
                waits=Table.from_msgpack(SIGNAL_COLUMNS, raw["waits"], what + ".waits"),
                peer_regions=_peer_regions(raw["peer_regions"]),
                stages=plan_int(raw["stages"]),
                identity=_part_identity(raw.get("identity")),
                shadow=None if raw.get("shadow") is None else
                ShadowPart.decode(raw["shadow"], what),
            )
        except PlanFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise PlanFormatError(f"rank plan is malformed ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, slots=True)
class Plan:
    header: PlanHeader
    """Fingerprint, options, stats, topology (`schemas/header.py`)."""
    ranks: tuple[RankPlan, ...]
    """Every rank's part, in rank order."""
    explain: Table = field(default_factory=lambda: Table.empty(EXPLAIN_COLUMNS))
    """Per logical tensor (index into `tensors`): who feeds whom (`EXPLAIN_COLUMNS`)."""
    tensors: tuple[str, ...] = ()
    """Logical tensor names, in model-spec order."""
    dag_nodes: Table = field(default_factory=lambda: Table.empty(DAG_NODE_COLUMNS))
    """Nodes of the stage DAG (`DAG_NODE_COLUMNS`)."""
    dag_edges: Table = field(default_factory=lambda: Table.empty(DAG_EDGE_COLUMNS))
    """Edges of the stage DAG (`DAG_EDGE_COLUMNS`)."""
    coverage: Table = field(default_factory=lambda: Table.empty(COVERAGE_COLUMNS))
    """Logical bytes of every target region, for `verify` (`COVERAGE_COLUMNS`)."""
    extra_blobs: tuple[tuple[str, Any], ...] = ()
    """Further named blobs of plain msgpack data, written after the others and read by name
    (`tensors/<rank>`: `schemas/tensors.py`)."""


def read_raw_header(f: BinaryIO, path: str = "plan") -> tuple[dict[str, Any], int]:
    """The checksummed header map of an open plan file (plain msgpack data, not yet checked
    key by key), and where its blobs start."""
    return _read_raw_header(f, path)[1:]


_HEADERS: dict[bytes, PlanHeader] = {}
"""Decoded headers by their checksum (a header is immutable; tools load one plan often)."""


def _read_raw_header(f: BinaryIO, path: str) -> tuple[bytes, dict[str, Any], int]:
    magic = f.read(len(MAGIC))
    if magic == b"RPLANBND":  # schemas/chunked_plan.py
        raise PlanFormatError(f"{path}: is a chunked plan (chunk plans, target.shadow: "
                              "{budget_bytes: N}); run it with executor.ChunkedShadow.load on "
                              "a target and executor.load_chunks on a source")
    if magic != MAGIC:
        raise PlanFormatError(f"{path}: not an rdma-plan file (bad magic); compile one with "
                              "`rdma-plan compile`")
    version, hlen = struct.unpack("<IQ", read_exact(f, 12, path))
    if version not in READ_VERSIONS:
        raise PlanFormatError(f"{path}: plan format version {version} is not supported (this "
                              f"build reads versions {', '.join(map(str, READ_VERSIONS))}); "
                              "recompile the plan")
    if hlen > MAX_HEADER_BYTES:
        raise PlanFormatError(f"{path}: header length {hlen:,} is over the {MAX_HEADER_BYTES:,}"
                              " bytes a plan header may have; the file is corrupt")
    header_bytes = read_exact(f, hlen, path)
    digest = checksum(header_bytes)
    if read_exact(f, 32, path) != digest:
        raise PlanFormatError(f"{path}: header checksum mismatch; the file is corrupt")
    header = unpack(header_bytes, f"{path} header")
    if not isinstance(header, dict) or not isinstance(header.get("blobs"), dict):
        raise PlanFormatError(f"{path}: header is malformed")
    return digest, header, len(MAGIC) + 12 + hlen + 32


def read_header(f: BinaryIO, path: str = "plan", key: bytes | None = None
                ) -> tuple[PlanHeader, int]:
    """The checked, typed header of an open plan file, and where its blobs start. With
    `key`, the plan must be signed with it (`schemas/integrity.py`)."""
    digest, raw, start = _read_raw_header(f, path)
    if key is not None:
        from .integrity import check_signature

        check_signature(raw, key, path)
    header = _HEADERS.get(digest)
    if header is None:
        header = PlanHeader.decode(raw, f"{path} header")
        if len(_HEADERS) >= 16:
            _HEADERS.clear()
        _HEADERS[digest] = header
    if not 0 <= header.world <= MAX_WORLD or not 0 <= header.stages <= MAX_STAGES:
        raise PlanFormatError(f"{path}: header says world={header.world}, stages="
                              f"{header.stages} (at most {MAX_WORLD} ranks and {MAX_STAGES} "
                              "stages); the file is corrupt")
    end = start + max((b.offset + b.length for b in header.blobs.values()), default=0)
    try:
        import os

        size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        size = end
    if size != end:  # a signature covers the header and the blobs: nothing else may be there
        raise PlanFormatError(f"{path}: the file has {size} bytes, its header and blobs "
                              f"{end}; the file is truncated or has bytes appended")
    return header, start


def read_blob(f: BinaryIO, header: PlanHeader, start: int, name: str,
              path: str = "plan") -> Any:
    entry = header.blobs.get(name)
    if entry is None:
        raise PlanFormatError(f"{path}: has no blob {name!r}")
    f.seek(start + entry.offset)
    what = f"{path} blob {name!r}"
    return unpack(inflate(read_exact(f, entry.length, what, entry.digest), what), what)


def check_blob(f: BinaryIO, header: PlanHeader, start: int, name: str,
               path: str = "plan") -> None:
    """What `read_blob` checks of a blob (its digest, its compact frame, plain msgpack),
    keeping nothing: for a reader that checks a blob it does not use."""
    entry = header.blobs.get(name)
    if entry is None:
        raise PlanFormatError(f"{path}: has no blob {name!r}")
    f.seek(start + entry.offset)
    what = f"{path} blob {name!r}"
    check_plain(inflate(read_exact(f, entry.length, what, entry.digest), what), what)


def open_plan(path: str) -> BinaryIO:
    """The plan file at `path`, opened for reading: a regular file only (a FIFO, a device
    or a folder is refused at once, never read), no NUL byte in the path."""
    from .safe_read import open_regular

    return open_regular(path, "plan", "give the path of a plan file (rdma-plan compile "
                        "writes one)", PlanFormatError)


def load_rank(path: str, rank: int, key: bytes | None = None) -> tuple[PlanHeader, RankPlan]:
    """Header and one rank's part, without decoding the other ranks (`key`: see
    `read_header`)."""
    with open_plan(path) as f:
        return load_rank_from(f, path, rank, key)


def load_rank_from(f: BinaryIO, path: str, rank: int, key: bytes | None = None
                   ) -> tuple[PlanHeader, RankPlan]:
    """`load_rank` of an open plan file (`path` names it in errors)."""
    header, start = read_header(f, path, key)
    return header, read_rank(f, header, start, rank, path)


def read_rank(f: BinaryIO, header: PlanHeader, start: int, rank: int,
              path: str = "plan") -> RankPlan:
    """One rank's part of an open plan file whose header (`read_header`: `header`, `start`)
    was read: for a reader that needs the header to know which rank it is."""
    if f"rank/{rank}" not in header.blobs:
        raise PlanFormatError(f"{path}: plan has no rank {rank} (it has {header.world} "
                              "ranks)")
    rp = RankPlan.decode(read_blob(f, header, start, f"rank/{rank}", path))
    if rp.rank != rank:
        raise PlanFormatError(f"{path}: blob rank/{rank} holds the plan of rank {rp.rank};"
                              " the file is corrupt")
    return rp


def load_plan(path: str, key: bytes | None = None) -> Plan:
    """The whole plan (tools, tests, verify)."""
    with open_plan(path) as f:
        return read_plan_from(f, path, key)


def read_plan_from(f: BinaryIO, path: str, key: bytes | None = None) -> Plan:
    """`load_plan` of an open plan file (`path` names it in errors)."""
    header, start = read_header(f, path, key)
    world = header.world
    names = [n for n in header.blobs if n.startswith("rank/")]
    if len(names) != world or \
            set(names) != {f"rank/{r}" for r in range(world)}:  # (len first: world=2**31)
        # every rank's plan, no more (a missing rank would leave its peers waiting)
        raise PlanFormatError(f"{path}: the header says world={world} but the file "
                              f"holds {len(names)} rank blobs; the file is corrupt")
    names = [f"rank/{r}" for r in range(world)]
    ranks = tuple(RankPlan.decode(read_blob(f, header, start, n, path)) for n in names)
    for n, rp in zip(names, ranks):
        if f"rank/{rp.rank}" != n:
            raise PlanFormatError(f"{path}: blob {n} holds the plan of rank {rp.rank}; "
                                  "the file is corrupt")
    ex = read_blob(f, header, start, "explain", path)
    dag = read_blob(f, header, start, "dag", path)
    tensors, explain = decode_explain(ex, path)
    if not isinstance(dag, dict):
        raise PlanFormatError(f"{path}: dag blob is malformed")
    try:
        nodes = Table.from_msgpack(DAG_NODE_COLUMNS, dag["nodes"], "dag.nodes")
        edges = Table.from_msgpack(DAG_EDGE_COLUMNS, dag["edges"], "dag.edges")
        coverage = Table.from_msgpack(COVERAGE_COLUMNS, dag["coverage"], "coverage")
    except (KeyError, TypeError) as e:
        raise PlanFormatError(f"{path}: dag blob is malformed ({e})") from None
    extra = tuple((n, read_blob(f, header, start, n, path)) for n in header.blobs
                  if not n.startswith("rank/") and n not in ("explain", "dag"))
    return Plan(header=header, ranks=ranks, explain=explain, tensors=tensors,
            dag_nodes=nodes, dag_edges=edges, coverage=coverage, extra_blobs=extra)


def decode_explain(ex: Any, path: str = "plan") -> tuple[tuple[str, ...], Table]:
    """The logical tensor names and the explain table of an `explain` blob."""
    if not isinstance(ex, dict) or not isinstance(ex.get("tensors"), list) \
            or not all(isinstance(t, str) for t in ex["tensors"]):
        raise PlanFormatError(f"{path}: explain blob is malformed")
    return tuple(ex["tensors"]), Table.from_msgpack(EXPLAIN_COLUMNS, ex.get("table"),
                                                    "explain")

