"""The bounds proof of one rank's plan: every op of every kind inside the regions it names.

`violations(rp, ...)` yields one message per failed check, in order (limits, regions,
writes, batches, copies, signals); the executor raises the first one before it allocates or
registers anything (`executor/check.py`), `verify` reports it. The footprints are those of
`schemas.protocol` (one function per op kind), counted from the start of each region, never
from a tensor's storage: a region bound to a view into a larger buffer is bounded by its own
bytes. Values are range-checked before any arithmetic, so nothing overflows int64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain

import numpy as np

from schemas.header import MAX_STAGES
from schemas.plan import (
    DTYPE_CODES,
    PACK,
    QUANT,
    STAGING,
    UNPACK,
    RankPlan,
    Table,
    region_facts,
)
from schemas.protocol import (
    FP8_BLOCK,
    FP8_CODE,
    MAX_OPS,
    MAX_VALUE,
    copy_footprint,
    copy_value_problems,
    overlapping_dst,
    sent_stage,
    staging_index,
    write_footprint,
)
from schemas.protocol import KINDS as SIGNAL_KINDS
from schemas.table import among, content_key, table_digest

TABLES = ("writes", "batches", "copies", "signals", "waits")
FLOAT_CODES = tuple(DTYPE_CODES.index(d) for d in ("bfloat16", "float16", "float32"))
"""dtypes a QUANT may read."""
KINDS = {"source": (PACK, QUANT), "target": (UNPACK,)}
"""Copy kinds each role runs."""
QUANT_PAD = 16
"""A QUANT's scratch (its box padded to whole 128x128 blocks) may be at most this many
times its box, or one block."""


def _row(t: Table) -> Callable[[int], str]:
    return lambda i: ", ".join(f"{n}={int(t[n][i])}" for n, _ in t.schema)


def _first(rp: RankPlan, table: str, bad: np.ndarray, why: str, t: Table) -> str | None:
    rows = np.flatnonzero(bad)
    if not len(rows):
        return None
    i = int(rows[0])
    return (f"rank {rp.rank}: {table} op {i} {why} ({_row(t)(i)}); {len(rows)} {table} op(s) "
            "fail this check. The plan is corrupt or was compiled for other tensors: "
            "recompile it")


def violations(rp: RankPlan, world: int | None = None,
               peer_sizes: dict[int, dict[int, int]] | None = None) -> Iterator[str]:
    """Messages of the checks `rp` fails, in order. `world`: ranks in the plan, if known;
    `peer_sizes`: byte sizes of peer regions (default: the rank's own `peer_regions`)."""
    for msg in _limits(rp, world):
        yield msg
        return  # later checks assume the limits
    sizes = region_facts(rp.regions).nbytes
    peers = _peer_table(rp.peer_regions) if peer_sizes is None else _columns(peer_sizes)
    for check in (_writes(rp, sizes, peers), _batches(rp), _copies(rp, sizes),
                  _signals(rp, world)):
        for msg in check:
            if msg is not None:
                yield msg


def order_violations(rp: RankPlan, world: int) -> Iterator[str]:
    """The subset a reader of the order alone needs (the simulator: it never touches
    memory): limits, batches, signals, and every write and copy in a stage and a world."""
    for msg in _limits(rp, world):
        yield msg
        return
    w, c = rp.writes, rp.copies
    for msg in (*_batches(rp), *_signals(rp, world),
                _first(rp, "write", (w["dst_rank"] < 0) | (w["dst_rank"] >= world)
                       | (w["dst_rank"] == rp.rank), "names an invalid dst rank", w),
                _first(rp, "copy", (c["stage"] < 0) | (c["stage"] >= rp.stages)
                       | ~among(c["kind"], KINDS.get(rp.role, ()))
                       | (c["src_dtype"] >= len(DTYPE_CODES))
                       | (c["dst_dtype"] >= len(DTYPE_CODES)),
                       "has a stage out of range, a kind its role does not run or an unknown "
                       "dtype code", c)):
        if msg is not None:
            yield msg


def _limits(rp: RankPlan, world: int | None) -> Iterator[str]:
    where = f"rank {rp.rank}"
    if world is not None and not 0 <= rp.rank < world:
        yield f"{where}: outside the plan's world of {world} ranks; the plan is corrupt"
    if not 0 <= rp.stages <= MAX_STAGES:
        yield f"{where}: stages is {rp.stages} (at most {MAX_STAGES}); the plan is corrupt"
    for name in TABLES:
        if len(getattr(rp, name)) > MAX_OPS:
            yield f"{where}: {len(getattr(rp, name))} {name} (at most {MAX_OPS})"
    if rp.role not in KINDS:
        yield f"{where}: role {rp.role!r} is neither 'source' nor 'target'"
    n = len(rp.regions)
    for i, r in enumerate(() if _regions_ok(rp) else rp.regions):
        if r.name == STAGING and (i != n - 1 or r.dtype != "uint8" or r.shape != (r.nbytes,)):
            yield (f"{where}: the staging region must be the last region, uint8, of shape "
                   f"(nbytes,); it is region {i} of {n}, {r.dtype} {list(r.shape)}")
        if not 0 <= r.nbytes <= MAX_VALUE:
            yield f"{where}: region {i} ({r.name}) has {r.nbytes} bytes"
    if _peer_regions_ok(rp, world):
        return
    for peer, regs in rp.peer_regions:
        if peer == rp.rank or peer < 0 or (world is not None and peer >= world) or \
                any(not 0 <= r <= MAX_OPS or not 0 <= b <= MAX_VALUE for r, b in regs):
            yield f"{where}: peer_regions entry of rank {peer} is invalid ({regs[:4]})"


def _regions_ok(rp: RankPlan) -> bool:
    """Every region within the checks of `_limits`, by whole-list passes (its per-region
    loop names the bad ones)."""
    try:
        facts = region_facts(rp.regions)
    except (OverflowError, TypeError, ValueError):  # a size past int64: the loop says so
        return False
    names, n = facts.names, len(rp.regions)
    return (STAGING not in names or (names.index(STAGING) == n - 1
                                     and names.count(STAGING) == 1
                                     and rp.regions[-1].dtype == "uint8"
                                     and rp.regions[-1].shape == (rp.regions[-1].nbytes,))) \
        and 0 <= int(facts.nbytes.min()) and int(facts.nbytes.max()) <= MAX_VALUE


def _peer_regions_ok(rp: RankPlan, world: int | None) -> bool:
    """Every `peer_regions` entry valid, by whole-list passes (the per-entry loop of
    `_limits` names the bad ones)."""
    peers, least, most = _peer_span(rp.peer_regions)
    top = world - 1 if world is not None else most[0]
    return rp.rank not in peers and all(0 <= lo and hi <= cap for lo, hi, cap
                                        in zip(least, most, (top, MAX_OPS, MAX_VALUE)))


_SPANS: list[tuple[tuple, tuple[frozenset[int], tuple[int, ...], tuple[int, ...]]]] = []


def _peer_span(pr: tuple) -> tuple[frozenset[int], tuple[int, ...], tuple[int, ...]]:
    """The peers of a `peer_regions` tuple, and the least and most of its peers, regions
    and sizes (0 for none); the last few kept by identity (equal lists decode to one tuple:
    `schemas.plan._peer_regions`)."""
    for seen, got in _SPANS:
        if seen is pr:
            return got
    peers = [p for p, _ in pr]
    regs = [r for _, rs in pr for r, _ in rs]
    sizes = [b for _, rs in pr for _, b in rs]
    got = (frozenset(peers), tuple(min(x, default=0) for x in (peers, regs, sizes)),
           tuple(max(x, default=0) for x in (peers, regs, sizes)))
    _SPANS[:] = [(pr, got), *_SPANS[:3]]
    return got


PeerTable = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""(peers named, sorted; then each listed (peer, region) as columns: peer, region, bytes)."""
_TABLES: list[tuple[tuple, PeerTable]] = []


def _peer_table(pr: tuple) -> PeerTable:
    """`_columns` of a rank's own `peer_regions`, the last few kept by identity."""
    for seen, got in _TABLES:
        if seen is pr:
            return got
    got = _columns({p: dict(rs) for p, rs in pr})
    for a in got:
        a.flags.writeable = False
    _TABLES[:] = [(pr, got), *_TABLES[:3]]
    return got


def _columns(peers: dict[int, dict[int, int]]) -> PeerTable:
    """The peers `peers` names (sorted), and every (peer, region) it lists with a peer in
    [0, 2**30) and a region in [0, MAX_OPS], as columns with its bytes."""
    named = np.array(sorted(peers), dtype=np.int64)
    listed_peers = [(p, rs) for p, rs in peers.items() if 0 <= p < (1 << 30)]
    count = np.array([len(rs) for _, rs in listed_peers], dtype=np.int64)
    p_col = np.repeat(np.array([p for p, _ in listed_peers], dtype=np.int64), count)
    r_col = np.fromiter(chain.from_iterable(rs.keys() for _, rs in listed_peers), np.int64,
                        int(count.sum()))
    n_col = np.fromiter(chain.from_iterable(rs.values() for _, rs in listed_peers), np.int64,
                        int(count.sum()))
    ok = (r_col >= 0) & (r_col <= MAX_OPS)
    return named, p_col[ok], r_col[ok], n_col[ok]


def _writes(rp: RankPlan, sizes: np.ndarray, peers: PeerTable
            ) -> Iterator[str | None]:
    w, nreg = rp.writes, len(rp.regions)
    nbytes, so, do = w["nbytes"], w["src_offset"], w["dst_offset"]
    yield _first(rp, "write", (nbytes <= 0) | (nbytes > MAX_VALUE) | (so < 0) | (so > MAX_VALUE)
                 | (do < 0) | (do > MAX_VALUE), "has a non-positive or huge size, or a negative "
                 "or huge offset", w)
    reg, lo, hi = write_footprint(rp, "src")
    yield _first(rp, "write", (reg < 0) | (reg >= nreg), f"names a src region outside [0, {nreg})",
                 w)
    yield _first(rp, "write", hi > sizes[np.clip(reg, 0, nreg)],
                 "reads past the end of its local src region", w)
    yield _first(rp, "write", w["dst_rank"] == rp.rank, "writes to its own rank", w)
    dst = w["dst_rank"].astype(np.int64)
    named, p_col, r_col, n_col = peers
    known = _among_sorted(dst, named)
    yield _first(rp, "write", ~known, "writes to a rank missing from peer_regions", w)
    reg, lo, hi = write_footprint(rp, "dst")
    # each write looks its (peer, region) up among those `peers` lists, and its bytes
    mine = known & (reg >= 0) & (reg <= MAX_OPS)
    listed, have = _lookup(p_col, r_col, n_col, dst, reg, mine)
    unlisted = known & ~listed
    peer = int(dst[np.argmax(unlisted)]) if unlisted.any() else -1
    yield _first(rp, "write", unlisted,
                 f"names a dst region of rank {peer} that peer_regions does not list", w)
    past = listed & (hi > have)
    peer = int(dst[np.argmax(past)]) if past.any() else -1
    yield _first(rp, "write", past, f"writes past the end of its dst region on rank {peer}", w)


_DIRECT = 1 << 22
"""Cells of a direct table (`_among_sorted`, `_lookup`) at most; past it, a sorted search."""


def _among_sorted(q: np.ndarray, named: np.ndarray) -> np.ndarray:
    """Which of `q` are in `named` (sorted, distinct): by a table indexed by value where
    `named` spans few values (ranks), else by one sorted search."""
    if not len(named):
        return np.zeros(len(q), dtype=bool)
    lo, hi = int(named[0]), int(named[-1])
    if lo >= 0 and hi < _DIRECT:
        table = np.zeros(hi + 2, dtype=bool)  # (the last cell: every value past `hi`)
        table[named] = True
        return table[np.clip(q, -1, hi + 1)]  # (-1: the last cell too)
    near = np.minimum(np.searchsorted(named, q), len(named) - 1)
    return named[near] == q


def _lookup(p: np.ndarray, r: np.ndarray, n: np.ndarray, q_p: np.ndarray, q_r: np.ndarray,
            mine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each query (`q_p`, `q_r`) where `mine`: whether (peer, region) is among the
    distinct pairs (`p`, `r`; region in [0, MAX_OPS]), and its bytes `n` (0 where not):
    by a direct table [peer, region] where it is small, else by one sorted search of
    `peer * (MAX_OPS + 1) + region`."""
    listed = np.zeros(len(q_p), dtype=bool)
    have = np.zeros(len(q_p), dtype=np.int64)
    if not len(p) or not mine.any():
        return listed, have
    peers, p_at = np.unique(p, return_inverse=True)
    width, top = int(r.max()) + 1, int(peers[-1])  # (`p` >= 0 here)
    if top < _DIRECT and len(peers) * width <= _DIRECT:
        row = np.full(top + 2, -1, dtype=np.int64)  # peer -> its row (the last: past `top`)
        row[peers] = np.arange(len(peers))
        at = row[np.clip(q_p, -1, top + 1)]
        ok = mine & (at >= 0) & (q_r < width)
        at = np.where(ok, at * width + np.clip(q_r, 0, width - 1), 0)
        cell = p_at.reshape(-1) * width + r
        is_listed = np.zeros(len(peers) * width, dtype=bool)
        is_listed[cell] = True
        size = np.zeros(len(peers) * width, dtype=np.int64)
        size[cell] = n
        listed = ok & is_listed[at]
        return listed, np.where(listed, size[at], 0)
    width = MAX_OPS + 1
    keys = p * width + r
    by_key = np.argsort(keys, kind="stable")
    keys, ps = keys[by_key], np.append(n[by_key], 0)
    wkey = np.where(mine, q_p * width + np.clip(q_r, 0, MAX_OPS), -1)
    at = np.minimum(np.searchsorted(keys, wkey), len(keys))
    listed = mine & (at < len(keys)) & (keys[np.minimum(at, len(keys) - 1)] == wkey)
    return listed, np.where(listed, ps[np.where(listed, at, len(keys))], 0)


def _batches(rp: RankPlan) -> Iterator[str | None]:
    b, n = rp.batches, len(rp.writes)
    start, stop = b["start"].astype(np.int64), b["stop"].astype(np.int64)
    expected = np.concatenate([[0], stop[:-1]]).astype(np.int64)
    yield _first(rp, "batch", (start != expected) | (stop <= start), "does not start where "
                 "the previous batch stops, or is empty (batches must cover the writes in "
                 "order)", b)
    if (len(b) and int(stop[-1]) != n) or (not len(b) and n):
        yield (f"rank {rp.rank}: batches cover writes [0, {int(stop[-1]) if len(b) else 0}) "
               f"but there are {n} writes; the plan is corrupt")
    yield _first(rp, "batch", (b["stage"] < 0) | (b["stage"] >= rp.stages),
                 f"has a stage out of range [0, {rp.stages})", b)
    yield _first(rp, "batch", (b["nic"] < 0) | (b["nic"] >= max(1, len(rp.nics))),
                 f"names a nic outside [0, {len(rp.nics)})", b)


_PROVEN: dict[bytes, None] = {}
"""Keys (`_copies_key`) of copy tables proven within bounds, each with everything of its
rank the proof reads: a rank whose copies, regions' sizes and dtypes, staging index, role
and stages equal an earlier rank's (every shard of one pipeline stage, every replica) has
the same proof, run once. A table that fails is never recorded: it is proven again, and
named, wherever it occurs."""
PROVEN_MAX = 4096


def _copies_key(rp: RankPlan, sizes: np.ndarray) -> bytes:
    facts = region_facts(rp.regions)
    return content_key(table_digest(rp.copies), sizes, facts.codes, staging_index(rp),
                       len(rp.regions), rp.role, rp.stages)


def _copies(rp: RankPlan, sizes: np.ndarray) -> Iterator[str | None]:
    """`_copy_proof`, once for equal inputs (`_PROVEN`)."""
    key = _copies_key(rp, sizes)
    if key in _PROVEN:
        return
    failed = False
    for msg in _copy_proof(rp, sizes):
        failed = failed or msg is not None
        yield msg
    if not failed:
        if len(_PROVEN) >= PROVEN_MAX:
            _PROVEN.clear()
        _PROVEN[key] = None


def _copy_proof(rp: RankPlan, sizes: np.ndarray) -> Iterator[str | None]:
    c, nreg = rp.copies, len(rp.regions)
    kinds = KINDS.get(rp.role, ())
    yield _first(rp, "copy", ~among(c["kind"], kinds), f"has a kind other than {kinds} "
                 f"(what a {rp.role} runs)", c)
    yield _first(rp, "copy", (c["stage"] < 0) | (c["stage"] >= rp.stages),
                 f"has a stage out of range [0, {rp.stages})", c)
    yield _first(rp, "copy", copy_value_problems(rp),
                 "has a negative or huge offset, stride or size", c)
    staging = staging_index(rp)
    codes = region_facts(rp.regions).codes
    for side in ("src", "dst"):
        reg, code = c[f"{side}_region"].astype(np.int64), c[f"{side}_dtype"].astype(np.int64)
        yield _first(rp, "copy", (reg < 0) | (reg >= nreg),
                     f"names a {side} region outside [0, {nreg})", c)
        yield _first(rp, "copy", code >= len(DTYPE_CODES), f"has an unknown {side} dtype code",
                     c)
        yield _first(rp, "copy", (reg != staging) & (code != codes[np.clip(reg, 0, nreg)]),
                     f"views its {side} tensor region as another dtype (only staging may be "
                     "viewed as any dtype)", c)
    quant = c["kind"] == QUANT
    yield _first(rp, "copy", quant & ((c["dst_region"] != staging) | (c["dst_dtype"] != FP8_CODE)
                                      | ~among(c["src_dtype"], FLOAT_CODES)
                                      | (c["size2"] != 1)),
                 "(QUANT) must read a float 2-d box (size2 = 1) and write float8_e4m3fn into "
                 "staging", c)
    m, n = c["size0"].astype(np.int64), c["size1"].astype(np.int64)
    pad = -(-m // FP8_BLOCK) * -(-n // FP8_BLOCK) * FP8_BLOCK * FP8_BLOCK
    yield _first(rp, "copy", quant & (pad > np.maximum(QUANT_PAD * m * n, FP8_BLOCK ** 2)),
                 f"(QUANT) has a box too thin for 128x128 blocks (its scratch would be over "
                 f"{QUANT_PAD} times the box)", c)
    for side in ("src", "dst"):
        rows, reg, lo, hi = copy_footprint(rp, side)
        bad = np.zeros(len(c), dtype=bool)
        bad[rows[hi > sizes[np.clip(reg, 0, nreg)]]] = True
        yield _first(rp, "copy", bad, f"reaches past the end of its {side} region", c)
    yield _first(rp, "copy", overlapping_dst(rp), "writes some element of its dst box twice "
                 "(overlapping strides)", c)


def _signals(rp: RankPlan, world: int | None) -> Iterator[str | None]:
    for name, t in (("signal", rp.signals), ("wait", rp.waits)):
        yield _first(rp, name, (t["stage"] < 0) | (t["stage"] >= rp.stages),
                     f"has a stage out of range [0, {rp.stages})", t)
        yield _first(rp, name, ~among(t["kind"], SIGNAL_KINDS), "has an unknown kind", t)
        far = (t["peer"] >= world) if world is not None else np.zeros(len(t), dtype=bool)
        yield _first(rp, name, (t["peer"] < 0) | (t["peer"] == rp.rank) | far,
                     "names an invalid peer", t)
    w = rp.waits
    yield _first(rp, "wait", sent_stage(w["kind"], w["stage"].astype(np.int64)) < 0,
                 "waits for an ACK sent before stage 0 (an ACK of stage s-1 frees stage s, a "
                 "SLOT_ACK of stage s-3 stage s)", w)
