"""Pass 8 (`gather`): target boxes gathered onto one source, then fanned out.

Two kinds of target box take this path instead of `lower`'s direct one:
- block-FP8 weights (`target.dtype: fp8_block128`): a 128x128 block must be quantized by
  one rank that holds all of it (`fp8.py` checks that target boxes are block-aligned);
- fine-cut boxes: a box that arrives in `c` source chunks at `h` target ranks costs
  `c * h` writes directly, but `c + h` when gathered first; `route` sends a box here
  when the writes saved outweigh the extra hop of its bytes (FSDP2 row shards of a
  tensor every target rank holds: 256 x 128 writes become 256 + 128).
All target ranks holding the same box (replicas, replicated tensors) receive the output
of one gather. For each target box:
- an *owner* source rank is chosen: the one holding most of the box (ties: the owner
  whose NIC has sent the fewest bytes so far, then the lowest rank: `assign`'s rule, with
  the box's fan-out to targets on other hosts as one unit);
- if the owner holds an FP8 box whole in one piece, QUANT reads it in place;
- an FP8 box whose source parts are block-aligned and not all whole rows (a column split:
  Megatron TP 4 halves of a vLLM TP 2 row-parallel weight), or all whole rows on the owner
  (Megatron's per-group q/k/v rows), is quantized part by part: QUANT reads the owner's
  parts in place and each other part from the owner's staging, where it lands whole (one
  write: the holder sends it as it is, or PACKs it first); each QUANT puts its values and
  scales where the whole box's would go (`schemas.protocol.quant_scales`). Gathered as
  rows of the whole box, a column part would take one write per row;
- otherwise the box is first gathered into the owner's staging: the owner PACKs its own
  parts, the other holders write theirs (source -> source writes); QUANT (FP8) writes the
  e4m3 box and its scales into the owner's staging, or a PACK casts the gathered box to
  the target dtype (plain boxes, when dtypes differ);
- the owner then writes the result (and the scales) to every target rank holding the box.
Rounds: the owner's buffers of one round fit `staging_bytes`; round k gathers in stage
`base + 2k` and converts and sends in stage `base + 2k + 1`, so the gather has landed
(DONE) before it is read, and the next round's gather into the same staging waits for
the owner's ACK. Where every box fits half a pool, each pool is split in halves, even
rounds in one and odd rounds in the other (`gather_out.Staging`, `gather_out.lowered`):
a round's gather packs then touch nothing the round before reads, so they run while that
round's fan-out is written (`schemas.protocol`'s early packs) instead of at the stage
boundary, and so do the QUANTs that read a box in place (put in the gather stage of their
round, not the convert stage: else they would overwrite what the round before sends, and
its last writes, then these QUANTs, then the next fan-out would run one after another);
a round holds half as much, which evens the owners' fan-out per round; and a holder's
gather into an owner's staging from round 1 on waits for the owner's SLOT_ACK of stage
s - 3 (the round two before, which used the same half), not its ACK of stage s - 1: a
holder is not held back by an owner still sending the round before. Only where the cost
model says it pays (`gather_out.halves_fit`: FP8, or few boxes a round).
The boxes QUANT reads in place come first, as columns (`gather_direct.py`); the others are
decided box by box, in order, and made as columns a block of boxes at a time
(`gather_batch.py`); a box that does not fit there (several holders of a chunk, a QUANT
part by part, ...) is `Gatherer.add`'s: its owner, parts and fan-out as columns where they
can be (`gather_rows.py`), else rows below.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy as np

from planner.collector import release_free
from planner.passes import gather_rows
from planner.passes.gather_batch import add_rest
from planner.passes.gather_box import Box, Slot, TargetRows, pick_owner
from planner.passes.gather_direct import add_direct
from planner.passes.gather_out import (
    Out,
    Rows,
    ScaleRows,
    Staging,
    align,
    explain_rows,
    halves_fit,
    lowered,
)
from planner.passes.intersect import PieceTable, intersect, take
from planner.passes.lower import Lowered
from planner.passes.route import Routes
from planner.rows import stable_argsort, unique_rows
from planner.spec import ModelSpec
from planner.topology import Topology
from schemas.config import ConfigError, Options
from schemas.plan import DTYPE_CODES, PACK, QUANT
from schemas.protocol import ALIGN, ITEM, scale_stride
from schemas.protocol import FP8_BLOCK as BLOCK

FP8_CODE = DTYPE_CODES.index("float8_e4m3fn")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Gathered:
    """What the gather pass adds to the plan."""

    lowered: Lowered | None
    """Its gathers, conversions and fan-out writes; None when no box takes this path."""
    explain: np.ndarray
    """(tensor, owner, staging region, target rank, target region, bytes) per fan-out."""
    owner_only: np.ndarray
    """Per plan rank: fan-out bytes to other hosts of the boxes only it could own."""
    unit_max: int
    """The largest fan-out (bytes) one owner took as a whole (the balance granularity)."""


def gather(spec: ModelSpec, src: PieceTable, routes: list[Routes], n_regions: np.ndarray,
           opts: Options, topo: Topology, base: int, sent: np.ndarray) -> Gathered:
    """Gathers, conversions (QUANT or cast) and fan-out writes of the target rows
    `gathered` of the one `Routes` in the list `routes`, in stages from `base` on; `sent`:
    bytes each NIC already sends to other hosts (owners are balanced on top of it). The
    list should hold the only reference to the routes: it is emptied, and their target
    pieces dropped once the rows the pass reads are taken."""
    if len(routes[0].gathered) == 0:
        routes.clear()
        return Gathered(None, explain_rows(Out()), np.zeros(len(n_regions), np.int64), 0)
    g = Gatherer(spec, src, routes, n_regions, opts, topo, base, sent)
    # room for as many writes and copies as the boxes can make (a chunk makes at most one
    # write, a target two, a chunk two copies, a box one more): filled, never copied
    g.out.writes.reserve(len(g.chunks) + 2 * len(g.w.rank))
    g.out.copies.reserve(2 * len(g.chunks) + len(g.tboxes))
    g.out.explain.reserve(len(g.w.rank))  # (one explain row a target)
    order = np.array(g.order(), dtype=np.int64)
    done = add_direct(g, order)
    release_free()  # (its columns' holes in the heap: add_rest's peak would sit on them)
    add_rest(g, order[done:])
    del order
    # the pass's state (its tables, as columns and lists) goes before its writes and
    # copies are made into columns: only the output is kept
    out, alloc, n, owner_only, unit_max = g.out, g.alloc, g.max_stage + 1, g.owner_only, \
        g.unit_max
    del g
    release_free()  # (the state's lists and small arrays leave holes in the heap)
    explain = explain_rows(out)
    return Gathered(lowered(out, alloc, n, base, n_regions), explain, owner_only, unit_max)


class Gatherer:
    """The pass's state across boxes: staging, NIC loads, owner rounds and the output."""

    def __init__(self, spec: ModelSpec, src: PieceTable, held: list[Routes],
                 n_regions: np.ndarray, opts: Options, topo: Topology, base: int,
                 sent: np.ndarray) -> None:
        """`held`: `gather`'s list of the routes, emptied here."""
        self.names = [t.name for t in spec.tensors]
        # each tensor's FP8 scale tensor (`<name>_scale_inv`), found from the scale names
        # (no name made and hashed per tensor, no list of the scale names' stems)
        index, suffix = dict(zip(self.names, range(len(self.names)))), len("_scale_inv")
        get, scale_id = index.get, {}
        for j, n in enumerate(self.names):
            if n.endswith("_scale_inv") and (i := get(n[:-suffix])) is not None:
                scale_id[i] = j
        del index
        self.src, self.n_regions, self.opts, self.base = src, n_regions, opts, base
        # int64 columns (a table's may be int32): the column paths make byte offsets
        routes = held.pop()
        w, s = (_wide(take(routes.targets, rows)) for rows in (routes.gathered, routes.scales))
        del routes  # (the target pieces: only these rows of them are read)
        self.tboxes, self.first, tb_of = unique_rows(  # (by one sort of row keys)
            np.stack([w.tensor, w.off0, w.off1, w.size0, w.size1], axis=1), True, True)
        self.chunks = _wide(intersect(spec, src, take(w, self.first)))
        # The columns read one row at a time, as lists (a numpy scalar costs far more),
        # each made on its first read: most boxes take the column paths, which read none.
        self.src_l = Rows(src, TargetRows.__slots__)
        self.chunks_l = Rows(self.chunks, ("off0", "off1", "size0", "size1", "sbox"))
        self.out_code = w.dtype[self.first].tolist()  # each box's target dtype
        self.holder_rows: dict[int, tuple[list[tuple[int, int]], tuple[int, ...]]] = {}
        self.by_parts, self.aligned = self._by_parts()
        one = np.diff(self.chunks.holder_ptr)[self.chunks.sbox] == 1
        self.multi = np.bincount(self.chunks.dst, weights=~one, minlength=len(self.tboxes)) \
            > 0  # boxes with a chunk that several ranks hold
        self.scale_tensor = np.full(len(self.names), -1, dtype=np.int64)
        self.scale_tensor[list(scale_id)] = list(scale_id.values())
        # the scale piece of each target row: same rank, scale tensor, offsets / 128
        self.scale_j = ScaleRows(s)(w.rank, self.scale_tensor[w.tensor], w.off0 // BLOCK,
                                    w.off1 // BLOCK)
        # of the target rows, only the columns read from here on
        self.w, self.s = TargetRows.of(w), TargetRows.of(s)
        del w, s
        self.w_l, self.s_l = (Rows(t, TargetRows.__slots__) for t in (self.w, self.s))
        world, self.out = len(n_regions), Out()
        owners = len(np.unique(src.rank[self.chunks.holders])) if len(self.chunks) else 0
        fan = (topo.nvlink_gbps if len(set(topo.host)) == 1 else topo.nic_gbps) * 1e9 / 8
        self.alloc = Staging(world, opts.staging_bytes, halves_fit(
            self.tboxes, self.w.dtype[self.first], src.dtype, opts.staging_bytes, owners,
            opts.pack_overhead_us * 1e-6, topo.nic_gbps * 1e9 / 8, opts.pack_gbps * 1e9 / 8, fan))
        self.stg = n_regions.tolist()
        self.host_a, self.nic_a = np.asarray(topo.host), np.asarray(topo.nic)
        self.host, self.nic = self.host_a.tolist(), self.nic_a.tolist()
        self.load = np.zeros(max(self.nic) + 1 if world else 0, dtype=np.int64)
        self.load[:len(sent)] += sent.astype(np.int64)
        self.owner_only, self.fanout = (np.zeros(world, dtype=np.int64) for _ in range(2))
        self.unit_max = 0
        self.rounds: dict[int, int] = {}  # owner -> first round that may still have room
        self.max_stage = base - 1
        self.chunk_ptr = np.searchsorted(self.chunks.dst, np.arange(len(self.tboxes) + 1))
        self.targets_of = stable_argsort(tb_of)
        self.target_ptr = np.searchsorted(tb_of[self.targets_of],
                                          np.arange(len(self.tboxes) + 1))

    @cached_property
    def chunk_ptr_l(self) -> list[int]:
        """`chunk_ptr` as a list (the row path's)."""
        return self.chunk_ptr.tolist()

    @cached_property
    def tboxes_l(self) -> list[list[int]]:
        """`tboxes` as lists (the row path's)."""
        return self.tboxes.tolist()

    def order(self) -> list[int]:
        """Boxes only one source can own first, then the rest largest first (list
        scheduling)."""
        chunks, hp = self.chunks, self.chunks.holder_ptr
        n_chunks = np.diff(self.chunk_ptr)
        first_chunk = self.chunk_ptr[:-1].clip(max=max(len(chunks) - 1, 0))
        n_holders = hp[chunks.sbox[first_chunk] + 1] - hp[chunks.sbox[first_chunk]] \
            if len(chunks) else np.zeros(len(self.tboxes), dtype=np.int64)
        forced = (n_chunks == 1) & (n_holders == 1)
        sizes = self.tboxes[:, 3] * self.tboxes[:, 4]
        return np.lexsort((np.arange(len(self.tboxes)), -sizes, ~forced)).tolist()

    def add(self, t: int) -> None:
        """Gather, convert and fan out target box `t`."""
        box = self._choose(t)
        slot = self._place(box)
        at = self._targets(t)
        self._account(box, slot, at)
        if box.parts:
            f_off = self._quant_parts(box, slot)
        elif box.direct:
            h = box.rows[0]
            src = self.src_l
            read = (src.region[h], src.base[h] + box.t0 * src.a0[h] + box.t1 * src.a1[h],
                    (src.a0[h], src.a1[h]))
            f_off = self._convert(box, slot, *read)
        elif not gather_rows.gather_parts(self, box, slot):
            for c, h in zip(box.chunks, box.rows):
                c0, c1 = self.chunks_l.off0[c], self.chunks_l.off1[c]
                into = slot.g_off // box.es + (c0 - box.t0) * box.n1 + (c1 - box.t1)
                self._gather_part(box, slot, c, h, into, box.n1)
        if not (box.parts or box.direct):
            f_off = self._convert(box, slot, self.stg[box.owner], slot.g_off // box.es,
                                  (box.n1, 1))
        if not gather_rows.fan_out(self, box, slot, f_off, at):
            for i in at.tolist():
                self._fan_out(box, slot, f_off, i)

    def src_rows(self, rows: np.ndarray) -> PieceTable:
        """Rows `rows` of the source piece table, with int64 columns."""
        return _wide(take(self.src, rows))

    def _targets(self, t: int) -> np.ndarray:
        return self.targets_of[self.target_ptr[t]:self.target_ptr[t + 1]]

    def _choose(self, t: int) -> Box:
        """The owner (`pick_owner`) and the source piece of each chunk (the owner's, else
        the least loaded)."""
        load, nic, cl = self.load, self.nic, self.chunks_l
        tensor, t0, t1, n0, n1 = self.tboxes_l[t]
        cs = range(self.chunk_ptr_l[t], self.chunk_ptr_l[t + 1])
        one = gather_rows.owner(self, t)  # as columns, where each chunk has one holder
        if one is not None:
            owner, rows, n_held = one
        else:
            cands = [self._holders(c) for c in cs]
            held: dict[int, int] = {}
            for c, (_, ranks) in zip(cs, cands):
                size = cl.size0[c] * cl.size1[c]
                for r in ranks:
                    held[r] = held.get(r, 0) + size
            owner = next(iter(held)) if len(held) == 1 else pick_owner(
                np.fromiter(held, np.int64, len(held)),
                np.fromiter(held.values(), np.int64, len(held)), load, self.nic_a, self.fanout)
            rows, n_held = [], len(held)
            for hs, _ in cands:
                mine = next((h for h, r in hs if r == owner), None)
                rows.append(mine if mine is not None else
                            min(hs, key=lambda hr: (load[nic[hr[1]]], hr[1]))[0])
        sl = self.src_l
        out_code, src_code = self.out_code[t], sl.dtype[rows[0]]
        es = int(ITEM[src_code])
        quant = out_code == FP8_CODE
        direct = quant and len(rows) == 1 and sl.rank[rows[0]] == owner
        parts = quant and not direct and (self.by_parts[t] or self.aligned[t] and all(
            sl.rank[h] == owner for h in rows))  # or whole-row parts, all the owner's
        g_bytes = 0 if direct else sum(align(cl.size0[c] * cl.size1[c] * es) for c, h in
                                       zip(cs, rows) if sl.rank[h] != owner) \
            if parts else align(n0 * n1 * es)
        return Box(tensor, t0, t1, n0, n1, cs, tuple(rows), owner, n_held == 1,
                    src_code, out_code, es, int(ITEM[out_code]), quant,
                    not quant and out_code != src_code, direct, parts, g_bytes)

    def _holders(self, c: int) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
        """(source piece row, its rank) of every holder of chunk `c`'s source box, in the
        chunk table's order, and those ranks once each (once per source box)."""
        sb = self.chunks_l.sbox[c]
        hs = self.holder_rows.get(sb)
        if hs is None:
            ptr, rank = self.chunks.holder_ptr, self.src_l.rank
            rows = [(h, rank[h]) for h in self.chunks.holders[ptr[sb]:ptr[sb + 1]].tolist()]
            hs = self.holder_rows[sb] = (rows, tuple(set(r for _, r in rows)))
        return hs

    def _by_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per box: it is cut into block-aligned parts (each starts on the box's 128-grid
        and ends on it or at the box's edge), not all of them whole rows; and the first
        condition alone (whole-row parts all on the owner: no gather, QUANTs run early)."""
        ch, tb = self.chunks, self.tboxes[self.chunks.dst]
        r0, r1 = ch.off0 - tb[:, 1], ch.off1 - tb[:, 2]
        m0, m1, n0, n1 = ch.size0, ch.size1, tb[:, 3], tb[:, 4]
        aligned = (r0 % BLOCK == 0) & (r1 % BLOCK == 0) \
            & ((m0 % BLOCK == 0) | (r0 + m0 == n0)) & ((m1 % BLOCK == 0) | (r1 + m1 == n1))
        n = len(self.tboxes)
        ok = np.bincount(ch.dst, weights=~aligned, minlength=n) == 0
        return ok & (np.bincount(ch.dst, weights=m1 < n1, minlength=n) > 0), ok

    def _place(self, b: Box) -> Slot:
        """The owner's first round whose two stages both have room for the box."""
        need = b.need
        if align(need) > self.alloc.caps[0]:
            raise ConfigError(
                f"options.staging_bytes: {self.opts.staging_bytes} is too small to gather "
                f"{self.names[b.tensor]} rows {b.t0}..{b.t0 + b.n0} cols {b.t1}..{b.t1 + b.n1}"
                f" ({need} bytes of staging, which must fit in 3/4 of the budget); raise "
                f"options.staging_bytes to at least {-(-need * 4 // 3) + ALIGN}")
        k, g_off = self.alloc.take_round(b.owner, self.base, self.rounds.get(b.owner, 0), need)
        self.rounds[b.owner] = k
        return Slot(self.base + 2 * k, self.base + 2 * k + 1, g_off, g_off + b.g_bytes,
                    g_off + b.g_bytes + b.f_bytes)

    def _account(self, b: Box, slot: Slot, to: np.ndarray) -> None:
        """The fan-out's bytes on the owner's NIC (NVLink loads none), and the bounds."""
        far = int(np.count_nonzero(self.host_a[self.w.rank[to]] != self.host[b.owner]))
        remote = b.numel * b.es_d * far
        self.load[self.nic[b.owner]] += remote
        self.fanout[b.owner] += (unit := b.numel * b.es_d * len(to))
        self.unit_max = max(self.unit_max, unit)
        if b.sole:
            self.owner_only[b.owner] += remote
        self.max_stage = max(self.max_stage, slot.convert)

    def _quant_parts(self, b: Box, slot: Slot) -> int:
        """QUANT box `b` part by part (`Box.parts`): the owner's parts read in place, the
        others' from where they land whole in its staging; returns the e4m3 box's offset."""
        src, chunks, at = self.src_l, self.chunks_l, slot.g_off
        stg = self.stg[b.owner]
        for c, h in zip(b.chunks, b.rows):
            c0, c1 = chunks.off0[c], chunks.off1[c]
            m0, m1 = chunks.size0[c], chunks.size1[c]
            if src.rank[h] == b.owner:
                read = (src.region[h], src.base[h] + c0 * src.a0[h] + c1 * src.a1[h],
                        (src.a0[h], src.a1[h]))
            else:
                self._gather_part(b, slot, c, h, at // b.es, m1)
                read = (stg, at // b.es, (m1, 1))
                at += align(m0 * m1 * b.es)
            self._convert(b, slot, *read, part=(c0 - b.t0, c1 - b.t1, m0, m1))
        return slot.f_off

    def _gather_part(self, b: Box, slot: Slot, c: int, h: int, into: int,
                     stride: int) -> None:
        """Chunk `c` from source piece `h` into the owner's staging at element `into`, in
        rows `stride` apart: a PACK on the owner, or a PACK on its holder then one write,
        or one write per row (one in all where both sides are dense)."""
        src, chunks, owner, es, code = self.src_l, self.chunks_l, b.owner, b.es, b.src_code
        stg = self.stg[owner]
        c0, c1 = chunks.off0[c], chunks.off1[c]
        m0, m1 = chunks.size0[c], chunks.size1[c]
        a0, a1, region = src.a0[h], src.a1[h], src.region[h]
        start = src.base[h] + c0 * a0 + c1 * a1
        hr = src.rank[h]
        if hr != owner and self.host[hr] != self.host[owner]:  # its NIC sends the part
            self.load[self.nic[hr]] += m0 * m1 * es
        rows_ok = a1 == 1 or m1 == 1  # a column is one strided run
        dense = rows_ok and (m0 == 1 or a0 == m1)
        if hr == owner:  # own part: straight into the gather buffer
            self.out.copy((owner, PACK, slot.gather, region, code, start, a0, a1, 1, stg, code,
                           into, stride, 1, 1, m0, m1, 1, 0))
        elif not dense and (m1 == stride or m0 == 1) \
                and self.alloc.fits(hr, (slot.gather,), m0 * m1 * es, 1):
            # strided on its holder: pack there, then one write
            off = self.alloc.take(hr, (slot.gather,), m0 * m1 * es, 1)
            self.out.copy((hr, PACK, slot.gather, region, code, start, a0, a1, 1,
                           self.stg[hr], code, off // es, m1, 1, 1, m0, m1, 1, 0))
            self.out.runs(slot.gather, (hr, self.stg[hr], off), (owner, stg, into * es), 1,
                          m0 * m1 * es, 0, 0)
            self.out.pool1.append((*self.out.last(), hr, es))
        elif rows_ok:
            self.out.runs(slot.gather, (hr, region, start * es), (owner, stg, into * es), m0,
                          m1 * es, a0 * es, stride * es)
        else:
            raise ConfigError(f"gather: {self.names[b.tensor]} is stored transposed on "
                              f"source rank {hr}; a gather needs rows")

    def _convert(self, b: Box, slot: Slot, region: int, offset: int,
                 strides: tuple[int, int], part: tuple[int, int, int, int] | None = None
                 ) -> int:
        """QUANT (FP8) or a casting PACK of the box (or of its block-aligned `part`: rows
        and columns from the box's corner, sizes) read at (`region`, element `offset`,
        `strides`) into the owner's staging, where the whole box's values and scales go;
        returns the byte offset the fan-out reads."""
        if not (b.quant or b.cast):
            return slot.g_off  # the gathered box is already the target's bytes
        r0, r1, m0, m1 = part or (0, 0, b.n0, b.n1)
        scales = slot.s_off // 4 + (r0 // BLOCK) * scale_stride(b.n1) + r1 // BLOCK
        # read in place, with halves: in the gather stage, early (the module's doc)
        stage = slot.gather if b.direct and self.alloc.halves else slot.convert
        self.out.copy((b.owner, QUANT if b.quant else PACK, stage, region, b.src_code,
                       offset, strides[0], strides[1], 1, self.stg[b.owner], b.out_code,
                       slot.f_off // b.es_d + r0 * b.n1 + r1, b.n1, 1, 1, m0, m1, 1,
                       scales if b.quant else 0))
        return slot.f_off

    def _fan_out(self, b: Box, slot: Slot, f_off: int, i: int) -> None:
        """The converted box (and its FP8 scales) to the target piece row `i`."""
        w, owner, es_d, n0, n1 = self.w_l, b.owner, b.es_d, b.n0, b.n1
        stg = self.stg[owner]
        d_rank, d_reg = w.rank[i], w.region[i]
        if w.a1[i] != 1 and n1 > 1:  # a column lands as one strided run
            raise ConfigError(f"gather: {self.names[b.tensor]} is transposed on target rank "
                              f"{d_rank}; gathered boxes must land as rows")
        d = w.base[i] + b.t0 * w.a0[i] + b.t1 * w.a1[i]
        self.out.runs(slot.convert, (owner, stg, f_off), (d_rank, d_reg, d * es_d), n0,
                      n1 * es_d, n1 * es_d, w.a0[i] * es_d)
        self.out.explain.append((b.tensor, owner, stg, d_rank, d_reg, b.numel * es_d))
        if not b.quant:
            return
        rb, cb = -(-n0 // BLOCK), -(-n1 // BLOCK)
        j = int(self.scale_j[i])
        if j < 0:
            raise ValueError(f"gather: target rank {d_rank} has no scale piece for "
                             f"{self.names[b.tensor]} block ({b.t0 // BLOCK}, "
                             f"{b.t1 // BLOCK})")
        s = self.s_l
        sd = s.base[j] + (b.t0 // BLOCK) * s.a0[j] + (b.t1 // BLOCK) * s.a1[j]
        self.out.runs(slot.convert, (owner, stg, slot.s_off), (d_rank, s.region[j], sd * 4),
                      rb, cb * 4, cb * 4, s.a0[j] * 4)


def _wide(t: T) -> T:
    """A table (`PieceTable`, `Chunks`) with its columns as int64."""
    return type(t)(*(getattr(t, f).astype(np.int64, copy=False) for f in t.__slots__))
