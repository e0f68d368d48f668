"""What the planner knows about an expert placement beyond its table (`schemas/placement.py`):
which logical tensors are experts (`ExpertIds`), and the fingerprint of a placement plan.

A placement plan's fingerprint is `schemas.placement.fingerprint(base, placement)`, where
`base` is the ordinary fingerprint (`passes/emit.fingerprint`) of the plan with every expert
piece of the target named as expert 0 of its layer and weight: everything the plan depends
on but the placement, the same for every placement of the same slot count. The header keeps
`base`, so a replan (`planner/replan.py`) gives the fingerprint a full compile gives.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from planner.layouts.vllm_rank import eplb_layers
from planner.passes.emit import fingerprint
from planner.passes.intersect import PieceTable
from planner.spec import ModelSpec
from planner.topology import Topology
from schemas import placement as placement_mod
from schemas.config import Config
from schemas.header import PlanHeader
from schemas.plan import Region

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(.+)\.experts\.(\d+)\.([^.]+)\.weight$")


_KEPT: list[tuple[ModelSpec, ExpertIds]] = []


@dataclasses.dataclass(frozen=True)
class ExpertIds:
    """Spec tensor ids of the routed experts: `ids[l, e, w]` is the id of MoE layer `l`'s
    expert `e`, weight `w` (`dims.expert_names` order); `layer`, `expert`, `weight` map an
    id back (-1: not an expert)."""

    ids: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    weight: np.ndarray
    index: dict[str, int]
    """Spec id of each logical tensor name."""
    wbits: int
    """Bits of the weight in a packed id (`packed`)."""
    packed: np.ndarray
    """Each spec id's (MoE layer * experts + expert) << `wbits` | weight (-1: not an
    expert) ..."""
    of_packed: np.ndarray
    """... and the spec id of each packed id (-1: none): one lookup for (layer, expert,
    weight) -> id (the replan's moved writes, `planner/replan_writes.py`)."""

    @staticmethod
    def of(spec: ModelSpec) -> ExpertIds:
        """The ids of `spec` (the last few specs' kept, most recently used last: a replan
        per placement change)."""
        for i, (kept, ids) in enumerate(_KEPT):
            if kept is spec:
                _KEPT.append(_KEPT.pop(i))
                return ids
        ids = ExpertIds._of(spec)
        _KEPT.append((spec, ids))
        del _KEPT[:-2]
        return ids

    @staticmethod
    def _of(spec: ModelSpec) -> ExpertIds:
        d = spec.dims
        moe = {layer: i for i, layer in enumerate(eplb_layers(d))}
        weights = {w: i for i, w in enumerate(d.expert_names)}
        names = [t.name for t in spec.tensors]
        index = dict(zip(names, range(len(names))))
        n = len(names)
        layer, expert, weight = (np.full(n, -1, np.int64) for _ in range(3))
        ids = np.full((len(moe), max(d.num_experts, 1), len(weights)), -1, np.int64)
        named = _named(names, index, moe, weights, ids.shape)
        if named is None:  # names of another form than `_named` makes: each one matched
            for i, lw in _matched(names, moe, weights, d.num_experts):
                layer[i], expert[i], weight[i] = lw
                ids[lw] = i
        else:
            ids = named
            at = np.nonzero(ids >= 0)
            i = ids[at]
            layer[i], expert[i], weight[i] = at
        wbits = max(ids.shape[2] - 1, 0).bit_length()
        of_packed = np.full((ids.shape[0] * ids.shape[1]) << wbits, -1, np.int64)
        of_packed.reshape(-1, 1 << wbits)[:, :ids.shape[2]] = ids.reshape(-1, ids.shape[2])
        packed = np.full(n, -1, np.int64)
        at = np.flatnonzero(of_packed >= 0)
        packed[of_packed[at]] = at
        return ExpertIds(ids, layer, expert, weight, index, wbits, packed, of_packed)

    def canonical(self, tensor: np.ndarray) -> np.ndarray:
        """`tensor` ids with every expert's replaced by expert 0's of its layer and weight."""
        out = np.asarray(tensor).astype(np.int64, copy=True)
        hit = self.layer[out] >= 0
        t = out[hit]
        out[hit] = self.ids[self.layer[t], 0, self.weight[t]]
        return out


def _matched(names: list[str], moe: dict[int, int], weights: dict[str, int],
             experts: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(index, (MoE layer, expert, weight)) of every name of `names` that `_EXPERT` matches
    with a layer of `moe`, a weight of `weights` and an expert below `experts`, in order."""
    out = []
    for i, name in enumerate(names):
        m = _EXPERT.match(name)
        if m is None or int(m[1]) not in moe or m[4] not in weights or int(m[3]) >= experts:
            continue
        out.append((i, (moe[int(m[1])], int(m[3]), weights[m[4]])))
    return out


def _named(names: list[str], index: dict[str, int], moe: dict[int, int],
           weights: dict[str, int], shape: tuple[int, ...]) -> np.ndarray | None:
    """`ExpertIds.ids` (of `shape`) of what `_matched` finds, found by making each expert's
    name from its layer's prefix (the names of expert 0 matched) and looking it up, matching
    only the other names holding ".experts."; None where that could differ from `_matched`:
    one of those matches (another form, a layer with two prefixes, a number written another
    way)."""
    prefix: dict[int, str] = {}
    for name in names:
        if ".experts.0." not in name:
            continue
        m = _EXPERT.match(name)
        if m is None or int(m[1]) not in moe:
            continue
        if prefix.setdefault(int(m[1]), m[2]) != m[2]:
            return None
    ids = np.full(shape, -1, np.int64)
    for layer, mid in prefix.items():
        for w, j in weights.items():
            made = [f"model.layers.{layer}.{mid}.experts.{e}.{w}.weight"
                    for e in range(shape[1])]
            ids[moe[layer], :, j] = np.fromiter(map(index.get, made, [-1] * len(made)),
                                                np.int64, len(made))
    made = np.zeros(len(names), bool)
    made[ids[ids >= 0]] = True
    rest = [n for n, m in zip(names, made.tolist()) if not m and ".experts." in n]
    if _matched(rest, moe, weights, shape[1]):
        return None
    return ids


def plan_fingerprint(spec: ModelSpec, src: PieceTable, dst: PieceTable,
                     regions: list[tuple[Region, ...]], topo: Topology, cfg: Config
                     ) -> tuple[str, str]:
    """(fingerprint, base): the ordinary fingerprint and "" without a placement; with one,
    the base over the target pieces with the experts unnamed, and the fingerprint of both."""
    placement = cfg.target.placement
    if placement is None:
        return fingerprint(spec, src, dst, regions, topo, cfg), ""
    ids = ExpertIds.of(spec)
    unnamed = dataclasses.replace(dst, tensor=ids.canonical(dst.tensor).astype(dst.tensor.dtype))
    base = fingerprint(spec, src, unnamed, regions, topo, cfg)
    return placement_mod.fingerprint(base, placement), base


def ep_rank(header: PlanHeader, rank: int) -> int:
    """Plan rank `rank`'s EP rank (which slots it holds), from its recorded identity: vLLM's
    `ep`; SGLang's EP spans its TP group."""
    ident = header.identities[rank] if header.identities else {}
    if header.target is not None and header.target.engine == "sglang":
        return int(ident.get("tp", 0))
    return int(ident.get("ep", 0))
