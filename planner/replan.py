"""Replan for a new expert placement: the previous plan edited where experts moved.

When an engine's EPLB moves experts (`schemas/placement.py`), only the writes into the moved
physical slots change: the target tensors, their regions and sizes stay (the slot count is
fixed), so every rank keeps its registered memory. `replan(plan, spec, new)` gives the plan a
full compile of the new placement gives, byte for byte, by editing the previous one:

- each write into a moved slot reads the new logical expert's source tensor instead of the
  old one's (same source rank, same offsets and length: the source holds every expert of a
  layer with the same cut, one piece per tensor, on one holder, and no pack, unpack or quant
  touches an expert); the writes of each (source, stage, target) group are put back in the
  order `coalesce` and `schedule` give (source region, target region, source offset), in
  the same table positions (the group's batches keep their cuts: else `NotIncremental`);
- the explain rows of the moved slots' target tensors, the target ranks' `tensors/<rank>`
  blobs, the header's placement and its fingerprint (`planner/placement.py`).

A source where that does not hold (experts on EP ranks: a moved expert's bytes come from
another rank, so its writes join another rank's batches and the schedule changes) is refused
with one line (`NotIncremental`): compile the new placement in full.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.errors import NotIncremental
from planner.layouts.vllm_rank import eplb_layers
from planner.placement import ExpertIds
from planner.replan_explain import explain
from planner.replan_tables import (
    Hits,
    Slots,
    SourceTensors,
    slot_regions,
    target_blobs,
)
from planner.replan_writes import replan_writes
from planner.spec import ModelSpec
from schemas import placement as placement_mod
from schemas.placement import Placement
from schemas.plan import Plan


def replan(plan: Plan, spec: ModelSpec, new: Placement) -> Plan:
    """The plan for placement `new`, from `plan` (compiled, or replanned, for another
    placement of the same slot count); raises `NotIncremental` (one line) when only a full
    compile can give it, `ConfigError` when `new` does not fit the model or the EP size."""
    h = plan.header
    old = h.placement
    if old is None or h.target is None:
        raise NotIncremental("replan: the plan records no expert placement (target.placement "
                             "was not set); compile it with one")
    d = spec.dims
    slots = slot_regions(plan, h, eplb_layers(d))
    ep = old.physical // max(1, slots[0].count) if slots else 1
    new.check(d.num_experts, len(eplb_layers(d)), ep)
    moved = old.moved(new)
    if len(moved) == 0:
        return plan
    ids = ExpertIds.of(spec)
    change = np.zeros(old.table.shape, bool)
    change[moved[:, 0], moved[:, 1]] = True
    run = np.concatenate([np.zeros((len(change), 1), np.int64), np.cumsum(change, 1)], 1)
    moe, first, count = (np.array([getattr(s, f) for s in slots], np.int64)
                         for f in ("moe", "first", "count"))
    any_moved = run[moe, first + count] > run[moe, first]  # a slot of the tensor moved
    hit = [slots[i] for i in np.flatnonzero(any_moved).tolist()]
    src, every = SourceTensors(plan, h.sources, spec, ids), Hits(slots)
    slot_moved = np.append(change.reshape(-1), False)
    ranks = list(plan.ranks)
    for r in range(h.sources):
        ranks[r] = replan_writes(plan.ranks[r], every, old, new, slot_moved, src, ids,
                                 h.options.max_write_bytes, h.sources, h.targets)
    _no_copies(plan, hit, h.sources)
    table = explain(plan.explain, slots, old, new, src, ids, h.sources)
    blobs = target_blobs(plan, hit, old, new, spec, ids, h.sources)
    header = dataclasses.replace(h, placement=new,
                                 target=dataclasses.replace(h.target, placement=new),
                                 fingerprint=placement_mod.fingerprint(h.placement_base, new))
    return dataclasses.replace(plan, header=header, ranks=tuple(ranks), explain=table,
                               extra_blobs=blobs)


def _no_copies(plan: Plan, hit: list[Slots], sources: int) -> None:
    """No unpack writes a moved slot's target tensor (its bytes come by direct writes)."""
    for s in hit:
        c = plan.ranks[s.rank].copies
        if len(c) and (c["dst_region"] == s.region).any():
            raise NotIncremental(f"replan: target rank {s.rank - sources} unpacks into a "
                                 f"stacked expert tensor of MoE layer {s.moe}; compile the "
                                 "new placement in full")

