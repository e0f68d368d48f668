"""The plan's invariants, checked on the plan alone (`rdma-plan verify`, property tests).

One implementation serves the CLI and the property suite:
- `bounds`: every write, batch and copy inside its regions; dtypes and kinds valid;
- `coverage`: every logical byte of every target region is written exactly once per run
  (by a write or an unpack), nothing outside it, and no two writes overlap in a
  destination (staging: per stage);
- `sizes`: no write above `max_write_bytes`, staging within `staging_bytes`;
- `staging_fit`: no rank's staging exceeds what its ops use at peak (the budget is a cap);
- `order`: the stage DAG is acyclic; every wait has its signal and vice versa; every
  (source, target, stage) with writes has READY and DONE; staged writes into a target's
  staging after stage 0 wait for its ACK of the stage before, or (slotted staging) touch no
  byte it still reads in the stages its SLOT_ACK does not cover;
- `dataflow`: staging is filled before it is read: every staging byte a write reads was
  packed or quantized by that rank in the write's stage (packs run before writes) or the
  stage before, or landed in the stage before (a gather),
  every staging byte an unpack reads was written into it in the unpack's stage (writes
  land before DONE, unpacks run after it); packs of one stage never overlap; a stage
  that packs early (`schemas/protocol.py`) packs into no byte a peer writes in the
  previous stage;
- `shadow` (plans compiled with `target.shadow`): each section's rules (`schemas/shadow.py`)
  and its regions exactly the bytes the plan writes into the rank;
- `balance`: where every source rank holds the whole model (pure data parallelism), the
  busiest source NIC sends at most the mean over source NICs plus one chunk
  (`planner/passes/assign.py`), in bytes of remote (non-NVLink) writes.
Each check returns violation messages; `verify_plan` gives them all, in that order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from planner.collector import gc_paused
from planner.rows import lexorder
from planner.tools.planfile import PlanFile, PlanRanks, ticker
from planner.tools.verify_rank import (
    acyclic,
    balance_msgs,
    rank_bounds,
    rank_coverage,
    rank_dataflow,
    rank_egress,
    rank_sizes,
    rank_staging_fit,
)
from planner.tools.verify_shadow import rank_shadow
from planner.writes import Incoming, concat
from schemas import rankcheck
from schemas.header import MAX_STAGES, PlanHeader
from schemas.intervals import distinct, ends_by_start, meets
from schemas.plan import ACK, DONE, READY, SLOT_ACK, UNPACK, Plan, RankPlan, region_facts
from schemas.protocol import (
    SLOTS,
    copy_extents,
    sent_stage,
    staging_index,
    wait_stage,
    write_stages,
)
from schemas.table import Table

CHECKS = ("bounds", "roles", "coverage", "sizes", "staging_fit", "order", "dataflow", "balance",
          "shadow")
Progress = Callable[[str], None]
_OFF = 2 * SLOTS
_NS = MAX_STAGES + 2 * _OFF


def _key(r: np.ndarray, s: np.ndarray, p: np.ndarray, k: np.ndarray, world: int) -> np.ndarray:
    """(rank, stage, peer, kind) as one int64 that sorts as the tuple does."""
    s = np.clip(np.asarray(s, np.int64) + _OFF, 0, _NS - 1)
    return ((np.asarray(r, np.int64) * _NS + s) * max(world, 1)
            + np.clip(np.asarray(p, np.int64), 0, max(world, 1) - 1)) * 4 \
        + np.clip(np.asarray(k, np.int64), 0, 3)


def _unkey(key: int, world: int) -> tuple[int, int, int, int]:
    key, k = divmod(int(key), 4)
    key, p = divmod(key, max(world, 1))
    r, s = divmod(key, _NS)
    return r, s - _OFF, p, k


class _Survey:
    """What pass 1 keeps of every rank: region sizes, signals, and the writes into each
    rank (`Incoming`); everything else is checked while the rank is decoded."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.sizes: dict[int, np.ndarray] = {}  # rank -> its regions' bytes (read-only)
        self.names: dict[int, tuple[str, ...]] = {}
        self.peer_regions: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.bounds: dict[int, str] = {}
        self.incoming = _Inbox()
        self.sent: list[np.ndarray] = []
        self.waited: dict[int, np.ndarray] = {}
        self.checked: set[int] = set()
        self.late: list[str] = []
        self.pairs: list[np.ndarray] = []
        self.egress: dict[str, int] = {}
        self.size_msgs: list[str] = []
        self.role_msgs: list[str] = []
        self.second: list[int] = []

    def add(self, rp: RankPlan, header: PlanHeader) -> None:
        w = self.world
        facts = region_facts(rp.regions)
        self.sizes[rp.rank] = facts.nbytes[:-1]
        self.names[rp.rank] = facts.names
        self.peer_regions[rp.rank] = _peer_columns(rp.peer_regions)
        msg = rank_bounds(rp, w)
        if msg is not None:
            self.bounds[rp.rank] = msg
            return  # its columns may be anything: nothing more is read from them
        opts = header.options
        self.size_msgs += rank_sizes(rp, opts.max_write_bytes, opts.staging_bytes)
        self.role_msgs += [*rankcheck.regions(rp), *rankcheck.roles(rp)]  # sources: _Results
        if rp.role == "source" and rp.nics:
            self.egress[rp.nics[0]] = self.egress.get(rp.nics[0], 0) + rank_egress(rp)
        s, g = rp.signals, rp.waits
        self.sent.append(_key(np.full(len(s), rp.rank), s["stage"], s["peer"], s["kind"], w))
        self.waited[rp.rank] = np.sort(_key(np.full(len(g), rp.rank), g["stage"], g["peer"],
                                            g["kind"], w))
        self.pairs.append(distinct(_key(np.full(len(rp.writes), rp.rank), write_stages(rp),
                                         rp.writes["dst_rank"], 0, w)))
        peers, at, block = outgoing_runs(rp)
        for peer in [p for p in peers.tolist() if p in self.checked]:
            self.late.append(f"rank {rp.rank} writes into rank {peer}, which waits for no "
                             f"DONE from rank {rp.rank}")
        self.incoming.add(peers, at, block)
        if staging_index(rp) >= 0 or (rp.copies["kind"] == UNPACK).any() or rp.shadow:
            self.second.append(rp.rank)

    def ready(self, rp: RankPlan) -> bool:
        """Whether every rank that may write into `rp` (those it waits for a DONE from) has
        been read: its checks against what lands in it can run now. A write from a rank read
        later is then a violation of its own (`late`)."""
        g = rp.waits
        writers = g["peer"][g["kind"] == DONE]
        return rp.rank not in self.bounds and bool((writers < rp.rank).all()) \
            and all(int(p) in self.sizes for p in distinct(writers).tolist())

    def bounds_msgs(self) -> list[str]:
        """Each rank's first bounds violation, or else its `peer_regions` (what its executor
        checks peers against at connect) not equal to the peers' real regions."""
        out = []
        ranks = sorted(self.sizes)
        # every rank's region sizes as one column; rank p's regions from first[p]
        count = np.zeros(self.world + 1, np.int64)
        count[ranks] = [len(self.sizes[r]) for r in ranks]
        first = np.concatenate([[0], np.cumsum(count)])
        have = np.concatenate([np.zeros(0, np.int64), *(self.sizes[r] for r in ranks)])
        for r in ranks:
            msg = self.bounds.get(r)
            if msg is None:
                p, reg, n = self.peer_regions[r]
                pc = np.clip(p, 0, self.world)
                known = (p >= 0) & (p < self.world) & (reg >= 0) & (reg < count[pc])
                at = np.where(known, first[pc] + np.where(known, reg, 0), 0)
                wrong = ~known | (have[np.minimum(at, max(len(have) - 1, 0))] != n) \
                    if len(have) else np.ones(len(p), bool)
                if wrong.any():
                    i = int(np.argmax(wrong))
                    msg = (f"rank {r}: peer_regions gives rank {int(p[i])} region "
                           f"{int(reg[i])} a size that rank does not have")
            if msg is not None:
                out.append(msg)
        return out


_PEER_COLUMNS: list[tuple[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]] = []


def _peer_columns(pr: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A rank's `peer_regions` as (peer, region, bytes) columns, read-only; the last few
    kept by identity (equal lists decode to one tuple: every source of a model's copy)."""
    for seen, got in _PEER_COLUMNS:
        if seen is pr:
            return got
    count = [len(regs) for _, regs in pr]
    flat = np.array([x for _, regs in pr for pair in regs for x in pair],
                    np.int64).reshape(-1, 2)
    got = (np.repeat(np.array([p for p, _ in pr], np.int64), count), flat[:, 0], flat[:, 1])
    for a in got:
        a.flags.writeable = False
    _PEER_COLUMNS[:] = [(pr, got), *_PEER_COLUMNS[:3]]
    return got


def outgoing_runs(rp: RankPlan) -> tuple[np.ndarray, np.ndarray, Incoming]:
    """What `rp`'s writes do to its peers (`planner.writes.outgoing`), with the writes that
    follow one another into a peer's region in one stage (one starts where the last ends)
    as one run: every check of the writes that land in a rank reads their bytes, never
    their count (their unions, overlaps and sums; a run's pieces are disjoint, so two runs
    share a byte exactly where two writes do), and a large plan's writes into a peer are
    mostly such runs (a tensor cut at `max_write_bytes`). Returned as the peers written
    (ascending), where each one's runs start in the block, and the block: every run,
    sorted by peer."""
    w, stage = rp.writes, write_stages(rp)
    if not len(w):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), Incoming.empty()
    dst, region = w["dst_rank"].astype(np.int64), w["dst_region"].astype(np.int64)
    lo = w["dst_offset"].astype(np.int64)
    hi = lo + w["nbytes"]
    order = lexorder(lo, stage, region, dst)
    dst, region, stage, lo, hi = dst[order], region[order], stage[order], lo[order], hi[order]
    first = np.ones(len(dst), dtype=bool)
    first[1:] = (dst[1:] != dst[:-1]) | (region[1:] != region[:-1]) \
        | (stage[1:] != stage[:-1]) | (lo[1:] != hi[:-1])
    start = np.flatnonzero(first)
    last = np.append(start[1:], len(dst)) - 1
    dst, region, stage, lo, hi = dst[start], region[start], stage[start], lo[start], hi[last]
    peers, at = np.unique(dst, return_index=True)
    src = np.full(len(dst), rp.rank, np.int64)
    return peers, at, Incoming(src, region, stage, lo, hi)


class _Inbox:
    """The runs that land in each rank, from the blocks of `outgoing_runs` (one a source
    rank, kept as they came), taken once per rank in source-rank order (`take`). The
    blocks read since the last `take` are joined into one segment then, and a rank's
    part is gathered from the segments by one index a segment: never an object or a
    slice per (writer, peer) pair. A segment is dropped once every part of it is taken."""

    def __init__(self) -> None:
        self.waiting: set[int] = set()  # ranks some run lands in, not yet taken
        self._blocks: list[tuple[np.ndarray, np.ndarray, Incoming]] = []
        self._segments: list[Incoming | None] = []
        self._left: list[int] = []  # parts of each segment not yet taken
        empty = np.zeros(0, np.int64)
        self._peer, self._seg, self._lo, self._hi = empty, empty, empty, empty

    def add(self, peers: np.ndarray, at: np.ndarray, block: Incoming) -> None:
        if len(peers):
            self._blocks.append((peers, at, block))
            self.waiting.update(peers.tolist())

    def __contains__(self, rank: int) -> bool:
        return rank in self.waiting

    def _join(self) -> None:
        """The blocks read since the last join as one segment, their parts in the table."""
        blocks, self._blocks = self._blocks, []
        size = [len(b.src) for _, _, b in blocks]
        base = np.cumsum([0, *size[:-1]])
        seg = len(self._segments)
        self._segments.append(Incoming(*(np.concatenate([getattr(b, f) for _, _, b in blocks])
                                         for f in ("src", "region", "stage", "lo", "hi"))))
        self._left.append(sum(len(p) for p, _, _ in blocks))
        peer = np.concatenate([p for p, _, _ in blocks])
        lo = np.concatenate([a + o for (_, a, _), o in zip(blocks, base.tolist())])
        hi = np.concatenate([np.append(a[1:], n) + o for (_, a, _), n, o
                             in zip(blocks, size, base.tolist())])
        keep = self._peer >= 0  # (parts taken are marked -1)
        self._peer = np.concatenate([self._peer[keep], peer])
        self._seg = np.concatenate([self._seg[keep], np.full(len(peer), seg, np.int64)])
        self._lo = np.concatenate([self._lo[keep], lo])
        self._hi = np.concatenate([self._hi[keep], hi])

    def take(self, rank: int) -> Incoming:
        """Every run that lands in `rank`, in source-rank order (then each source's run
        order); none are kept for it after."""
        if rank not in self.waiting:
            return Incoming.empty()
        self.waiting.discard(rank)
        if self._blocks:
            self._join()
        mine = np.flatnonzero(self._peer == rank)
        self._peer[mine] = -1
        seg, lo, hi = self._seg[mine], self._lo[mine], self._hi[mine]
        parts = []
        for k in np.unique(seg).tolist():  # (in order: segments are joined in read order)
            m = seg == k
            n = hi[m] - lo[m]
            idx = np.repeat(lo[m] - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
            got = self._segments[k]
            parts.append(Incoming(*(getattr(got, f)[idx]
                                    for f in ("src", "region", "stage", "lo", "hi"))))
            self._left[k] -= int(m.sum())
            if not self._left[k]:
                self._segments[k] = None
        return parts[0] if len(parts) == 1 else concat(parts)


def _acks(rp: RankPlan, inc: Incoming, waited: dict[int, np.ndarray], world: int
          ) -> list[tuple[int, int, str]]:
    """Writes into `rp`'s staging after stage 0 whose writer waits for no ACK of the stage
    before touch no byte `rp` may still read (SLOT_ACK: in the stages it does not cover)."""
    sg = staging_index(rp)
    m = (inc.region == sg) & (inc.stage > 0) if sg >= 0 else np.zeros(0, bool)
    if not m.any():
        return []
    src, st, lo, hi = inc.src[m], inc.stage[m], inc.lo[m], inc.hi[m]
    pair = src * _NS + np.clip(st + _OFF, 0, _NS - 1)
    keys, inv = np.unique(pair, return_inverse=True)
    inv = inv.reshape(-1)
    g_src, g_st = keys // _NS, keys % _NS - _OFF
    me = np.full(len(keys), rp.rank)
    # each writer's waits are sorted and its keys lead with its rank: in writer order,
    # they concatenate to one sorted array
    peers = distinct(g_src).tolist()
    waited = np.concatenate([np.zeros(0, np.int64),
                             *(waited.get(int(p), np.zeros(0, np.int64)) for p in peers)])
    acked = _member(_key(g_src, g_st, me, ACK, world), waited)
    slot = _member(_key(g_src, g_st, me, SLOT_ACK, world), waited)
    if acked.all():
        return []
    w, c = rp.writes, rp.copies
    wst = write_stages(rp)
    mw = w["src_region"] == sg
    mc = np.flatnonzero(c["src_region"] == sg)
    c_lo, c_hi = copy_extents(rp, "src", mc)
    r_st = np.concatenate([wst[mw], c["stage"][mc].astype(np.int64)])
    r_lo = np.concatenate([w["src_offset"][mw].astype(np.int64), c_lo])
    r_hi = np.concatenate([w["src_offset"][mw] + w["nbytes"][mw], c_hi])
    order = np.argsort(r_st, kind="stable")
    r_st, r_lo, r_hi = r_st[order], r_lo[order], r_hi[order]
    # each group's writes one slice (in their order), each group's reads (stages
    # freed+1 .. s-1) one slice of the reads by stage, made ready once per slice
    by_g = np.argsort(inv, kind="stable")
    at = np.searchsorted(inv[by_g], np.arange(len(keys) + 1))
    lo, hi = lo[by_g], hi[by_g]
    todo = np.flatnonzero(~acked)
    freed = np.where(slot[todo], g_st[todo] - SLOTS, -1)
    first, stop = np.searchsorted(r_st, freed + 1), np.searchsorted(r_st, g_st[todo])
    reads: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for g, f, a, b in zip(todo.tolist(), freed.tolist(), first.tolist(), stop.tolist()):
        s, writer = int(g_st[g]), int(g_src[g])
        got = reads.get((a, b))
        if got is None:
            got = reads[(a, b)] = ends_by_start(r_lo[a:b], r_hi[a:b])
        if meets((lo[at[g]:at[g + 1]], hi[at[g]:at[g + 1]]), got):
            out.append((writer, s, f"rank {writer} writes into rank {rp.rank}'s staging in "
                        f"stage {s} bytes that rank {rp.rank} may still read in stages "
                        f"{f + 1}..{s - 1} (it waits for no ACK of stage s-1)"))
    return out


def _member(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Which of `q` are in the sorted array `keys`."""
    if not len(keys):
        return np.zeros(len(q), bool)
    i = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
    return keys[i] == q


def _keys(parts: list[np.ndarray]) -> np.ndarray:
    return distinct(np.concatenate([np.zeros(0, np.int64), *parts]))


def _order(survey: _Survey, nodes_edges: tuple, acks: list[tuple[int, int, str]]
           ) -> list[str]:
    out = []
    nodes, edges = nodes_edges
    if not acyclic(len(nodes), edges["u"], edges["v"]):
        out.append("the stage DAG has a cycle")
    w = survey.world
    sent, waited = _keys(survey.sent), _keys(list(survey.waited.values()))
    for keys, other, fn, what in ((waited, sent, sent_stage, "w"), (sent, waited, wait_stage,
                                                                     "s")):
        if not len(keys) or len(out) >= 5:
            continue
        key, k = np.divmod(keys, 4)
        key, p = np.divmod(key, max(w, 1))
        r, s = np.divmod(key, _NS)
        s = s - _OFF
        missing = np.flatnonzero(~_member(_key(p, fn(k, s), r, k, w), other))
        for i in missing[:5].tolist():
            rr, ss, pp, kk = _unkey(keys[i], w)
            out.append(f"rank {rr} waits for signal kind {kk} from rank {pp} in stage {ss}, "
                       "which is never sent" if what == "w" else
                       f"rank {rr} sends signal kind {kk} to rank {pp} in stage {ss}, which "
                       "nobody waits for")
    pairs = _keys(survey.pairs)
    key, _ = np.divmod(pairs, 4)
    key, p = np.divmod(key, max(w, 1))
    r, s = np.divmod(key, _NS)
    s = s - _OFF
    done = _member(_key(r, s, p, DONE, w), sent)  # (`sent`, `waited`: sorted, distinct)
    ready = _member(_key(p, 0, r, READY, w), sent)
    for i in np.flatnonzero(~(done & ready))[:5].tolist():
        out.append(f"rank {int(r[i])} writes to rank {int(p[i])} in stage {int(s[i])} without "
                   "READY and DONE signals")
    out += survey.late[:5] + [m for _, _, m in sorted(acks)]
    return out[:5]


class _Results:
    """What the checks against the writes that land in a rank found, rank by rank."""

    def __init__(self) -> None:
        self.coverage: list[str] = []
        self.staging_fit: list[str] = []
        self.dataflow: list[str] = []
        self.written: list[tuple[int, np.ndarray, np.ndarray]] = []  # (rank, regions, bytes)
        self.acks: list[tuple[int, int, str]] = []
        self.roles: list[str] = []
        self.shadow: list[str] = []

    def add(self, rp: RankPlan, survey: _Survey) -> None:
        r = rp.rank
        inc = survey.incoming.take(r)
        sg = staging_index(rp)
        msgs, wr = rank_coverage(rp, inc, sg)
        self.coverage += msgs
        self.written.append((r, *wr))
        if sg >= 0:
            self.staging_fit += rank_staging_fit(rp, inc)
        self.dataflow += rank_dataflow(rp, inc)
        self.shadow += rank_shadow(rp, inc)  # the section's rules; its bytes against inc
        self.acks += _acks(rp, inc, survey.waited, survey.world)
        if rp.role == "source" and (inc.region != sg).any():
            i = int(np.argmax(inc.region != sg))
            self.roles.append(f"rank {int(inc.src[i])} writes region {int(inc.region[i])} of "
                              f"source rank {r}, which is not that rank's staging; a source's "
                              f"weights are never written ({rankcheck.FIX})")


HOLD_BYTES = 256 << 20
"""Bytes of decoded parts `check` keeps for the end (ranks written by later ranks) rather
than reading and decoding them again."""


def _held_bytes(rp: RankPlan) -> int:
    return sum(a.nbytes for t in (rp.writes, rp.batches, rp.copies, rp.signals, rp.waits)
               for a in t.columns)


def check(src: PlanRanks, progress: Progress | None = None, stop_on_bounds: bool = True,
          replicated: bool | None = None) -> dict[str, list[str]]:
    """Every check's violations (`CHECKS`), reading `src` one rank at a time: each rank's
    own checks, and what its peers need is kept (`_Survey`); a rank whose writers have all
    been read is also checked against the writes that land in it (`_Results`), the others
    (a rank written by a later one) at the end: kept from the first read up to
    `HOLD_BYTES`, read again beyond. With `stop_on_bounds`,
    nothing past the bounds proof is reported for a plan that fails it."""
    with gc_paused():
        return _check(src, progress, stop_on_bounds, replicated)


def _check(src: PlanRanks, progress: Progress | None, stop_on_bounds: bool,
           replicated: bool | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in CHECKS}
    world, header = src.world, src.header
    survey, res = _Survey(world), _Results()
    held: dict[int, RankPlan] = {}  # ranks to check at the end, kept while they fit
    room = HOLD_BYTES
    tick = ticker(progress, "ranks", world)
    for r in range(world):
        rp = src.rank(r)
        survey.add(rp, header)
        if survey.second and survey.second[-1] == r or r in survey.incoming:
            if survey.ready(rp):
                res.add(rp, survey)
                survey.checked.add(r)
        if r not in survey.checked and r not in survey.bounds and _held_bytes(rp) <= room \
                and (survey.second and survey.second[-1] == r or (rp.waits["kind"] == DONE).any()):
            held[r] = rp
            room -= _held_bytes(rp)
        del rp
        tick(r)
    out["bounds"] = survey.bounds_msgs()
    if out["bounds"] and stop_on_bounds:
        return out
    todo = [r for r in sorted(set(survey.second) | survey.incoming.waiting)
            if r not in survey.checked and r not in survey.bounds]
    tick = ticker(progress, "ranks written by later ranks", len(todo))
    for i, r in enumerate(todo):
        res.add(held.pop(r, None) or src.rank(r), survey)
        tick(i)
    held.clear()
    out["sizes"] = survey.size_msgs
    out["roles"] = (survey.role_msgs + res.roles)[:5]
    out["balance"] = balance_msgs(header, survey.egress, replicated)
    out["coverage"], out["staging_fit"] = res.coverage, res.staging_fit
    out["dataflow"] = res.dataflow[:5]
    out["shadow"] = res.shadow[:5]
    nodes, edges, cov = src.dag()
    src.check_rest(progress)
    out["coverage"] += _coverage_table(cov, survey, res.written)
    out["order"] = _order(survey, (nodes, edges), res.acks)
    return out


def _coverage_table(cov: Table, survey: _Survey,
                    written: list[tuple[int, np.ndarray, np.ndarray]]) -> list[str]:
    """Each coverage row names a region that exists and holds what is written into it per
    run (`written`: each checked rank's regions and bytes written), in the table's order:
    every row looked up at once, the messages made for the rows that fail."""
    world = survey.world
    rank, reg = cov["rank"].astype(np.int64), cov["region"].astype(np.int64)
    nbytes = cov["nbytes"].astype(np.int64)
    count = np.zeros(world + 1, np.int64)  # regions of each rank (a rank not read: 0)
    known = [r for r in survey.sizes if 0 <= r < world]
    count[known] = [len(survey.sizes[r]) for r in known]
    exists = (rank >= 0) & (rank < world) & (reg >= 0) \
        & (reg < count[np.clip(rank, 0, world)])
    # bytes written per (rank, region), as one sorted key; each row looks its own up
    width = int(max(count.max(initial=0), 1))
    w_rank = np.concatenate([np.zeros(0, np.int64)]
                            + [np.full(len(g), r, np.int64) for r, g, _ in written])
    w_reg = np.concatenate([np.zeros(0, np.int64)] + [np.asarray(g, np.int64)
                                                      for _, g, _ in written])
    w_n = np.concatenate([np.zeros(0, np.int64)] + [np.asarray(n, np.int64)
                                                    for _, _, n in written])
    inside = (w_reg >= 0) & (w_reg < width)  # (a region that exists: below its rank's count)
    keys = w_rank[inside] * width + w_reg[inside]
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], np.append(w_n[inside][order], 0)
    want = np.where(exists, rank * width + np.where(exists, reg, 0), -1)
    at = np.searchsorted(keys, want)
    hit = exists & (at < len(keys)) & (keys[np.minimum(at, max(len(keys) - 1, 0))] == want) \
        if len(keys) else np.zeros(len(want), bool)
    got = np.where(hit, vals[np.where(hit, at, len(keys))], 0)
    out = []
    for i in np.flatnonzero(~exists | (got != nbytes)).tolist():
        r, g = int(rank[i]), int(reg[i])
        if not exists[i]:
            out.append(f"coverage names region {g} of rank {r}, which does not exist")
        else:
            out.append(f"rank {r} {survey.names[r][g]}: {int(got[i])} bytes written per run, "
                       f"but it holds {int(nbytes[i])} logical bytes")
    return out


def _one(plan: Plan, name: str) -> list[str]:
    return check(PlanRanks(plan), stop_on_bounds=False)[name]


def roles(plan: Plan) -> list[str]:
    """Each op writes only what its role may (`schemas.rankcheck.roles`; writes into a
    source exact here: every rank's staging index is known)."""
    return _one(plan, "roles")


def bounds(plan: Plan) -> list[str]:
    """The bounds proof (`schemas.bounds`, the executor's own load-time check) of every rank,
    and every rank's `peer_regions` equal to the regions its peers really have."""
    return check(PlanRanks(plan))["bounds"]


def coverage(plan: Plan) -> list[str]:
    return _one(plan, "coverage")


def sizes(plan: Plan) -> list[str]:
    return _one(plan, "sizes")


def staging_fit(plan: Plan) -> list[str]:
    return _one(plan, "staging_fit")


def order(plan: Plan) -> list[str]:
    return _one(plan, "order")


def dataflow(plan: Plan) -> list[str]:
    return _one(plan, "dataflow")


def nic_egress(plan: Plan) -> dict[str, int]:
    """Bytes each source NIC sends per run (remote writes; NVLink batches excluded)."""
    out: dict[str, int] = {}
    for rp in plan.ranks:
        if rp.role == "source" and rp.nics:
            out[rp.nics[0]] = out.get(rp.nics[0], 0) + rank_egress(rp)
    return out


def fully_replicated(header: PlanHeader) -> bool:
    """Whether every source rank holds the whole model (the compiler stores it)."""
    return header.source_replicated


def balance(plan: Plan, replicated: bool | None = None) -> list[str]:
    """The per-NIC balance bound of `assign` where it is promised (see module docstring).

    A chunk is at most `max_write_bytes` (or one row of its target box, where a row is
    longer: `split_rows` never cuts a row); a box that takes the gather pass goes to its
    least-loaded owner as one unit of its whole fan-out (`stats.gather_unit_max`). The
    slack allowed is the larger unit."""
    return balance_msgs(plan.header, nic_egress(plan), replicated)


def _report(res: dict[str, list[str]]) -> list[str]:
    if res["bounds"]:
        return res["bounds"]
    return [m for name in CHECKS[1:] for m in res[name]]


def verify_plan(plan: Plan) -> list[str]:
    """All violations, in check order (bounds first: later checks assume them)."""
    return _report(check(PlanRanks(plan)))


def verify_file(path: str, progress: Progress | None = None) -> list[str]:
    """`verify_plan` of the plan at `path`, holding one rank's part at a time."""
    with PlanFile(path) as src:
        return _report(check(src, progress))
