"""The engine's current expert placement, read from its model, against the plan's.

vLLM (EPLB on) gives every MoE layer views of its `EplbState` maps: `logical_to_physical_map`
`[E, max replicas]` (-1 padded) and `logical_replica_count` `[E]` (`EplbLayerState`, set by
`MixtureOfExperts.set_eplb_state` and updated in place by each rearrangement). Their inverse
is the layer's row of `physical_to_logical_map`: what `schemas.placement.Placement` holds.
SGLang keeps the table itself (`ExpertLocationMetadata.physical_to_logical_map`
`[layers, physical]`). Each adapter gives its engine core a reader of it (`vllm_placement`,
`sglang_current`), which the core asks at the start of each update and at a plan switch
(`check`), refusing a plan compiled for another placement before anything is written: a
write into a slot whose expert moved would land the wrong expert's weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from integrations.errors import PlacementMismatchError
from schemas.placement import Placement


def _layer_state(module: torch.nn.Module) -> Any | None:
    """The `EplbLayerState`-like object of one vLLM MoE module (None: EPLB off)."""
    for path in (("runner", "router", "eplb_state"), ("router", "eplb_state"),
                 ("eplb_state",), ("runner", "eplb_state")):
        obj: Any = module
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is not None and getattr(obj, "logical_to_physical_map", None) is not None:
            return obj
    return None


def moe_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE layers in EPLB order (`MixtureOfExperts.moe_layers` when the model
    lists them, else the modules with stacked `w13_weight`, in module order)."""
    listed = getattr(model, "moe_layers", None)
    if listed:
        return list(listed)
    return [m for _, m in model.named_modules()
            if hasattr(m, "moe_config") and hasattr(m, "w13_weight")]


def vllm_placement(model: torch.nn.Module) -> Placement | None:
    """The placement vLLM's EPLB state holds now (None: EPLB is off on this model)."""
    rows = []
    for module in moe_modules(model):
        state = _layer_state(module)
        if state is None:
            return None
        l2p = state.logical_to_physical_map.detach().to("cpu", torch.int64).numpy()
        count = state.logical_replica_count.detach().to("cpu", torch.int64).numpy()
        rows.append(_inverse(l2p, count))
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return Placement(np.stack(rows))


def _inverse(l2p: np.ndarray, count: np.ndarray) -> np.ndarray:
    """physical -> logical from logical -> physical replicas (each slot named once)."""
    e = np.repeat(np.arange(len(count)), count)
    slots = l2p[np.arange(l2p.shape[1]) < count[:, None]]
    row = np.full(int(count.sum()), -1, np.int64)
    row[slots] = e
    return row


def sglang_placement(metadata: Any, moe_layers: int) -> Placement | None:
    """SGLang's `ExpertLocationMetadata` (or None) as a placement of `moe_layers` rows: its
    table has a row per decoder layer (dense ones trivial), the MoE layers last (DeepSeek's
    `first_k_dense_replace`; every layer in Qwen3-MoE)."""
    if metadata is None:
        return None
    table = metadata.physical_to_logical_map
    table = table.detach().cpu().numpy() if isinstance(table, torch.Tensor) else table
    return Placement(np.asarray(table)[-moe_layers:])


def sglang_metadata() -> Any | None:
    """SGLang's process-wide expert location metadata (None: not set, or no SGLang)."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    except ImportError:
        return None
    return get_global_expert_location_metadata()


def sglang_current(plan: Placement | None) -> Placement | None:
    """SGLang's current placement (the SGLang target's reader, `EngineCore`'s `placement`),
    as many MoE rows as the plan's `plan` (without one: every row SGLang keeps)."""
    meta = sglang_metadata()
    rows = plan.layers if plan is not None else getattr(meta, "num_layers", 0)
    return sglang_placement(meta, rows)


def check(engine: Placement | None, plan: Placement | None, where: str) -> None:
    """Refuse, in one line naming the first MoE layer and slot that differ, a plan whose
    placement is not the engine's. A plan without one targets the default placement:
    refused on an engine whose experts were moved or replicated."""
    if plan is None and engine is None:
        return
    if plan is None:
        default = np.arange(engine.physical)[None, :].repeat(engine.layers, 0)
        if np.array_equal(engine.table, default):
            return
        plan, label = Placement(default), "the default placement (no target.placement)"
    else:
        label = f"placement {plan.digest()[:12]}"
    if engine is None:
        raise PlacementMismatchError(
            f"{where}: the plan was compiled for {label}, the engine runs without EPLB; "
            "start it with --enable-eplb and that placement, or compile without "
            "target.placement")
    if engine.table.shape != plan.table.shape:
        raise PlacementMismatchError(
            f"{where}: the engine has {engine.layers} MoE layers x {engine.physical} physical "
            f"experts, the plan {plan.layers} x {plan.physical}; compile for the engine's "
            "placement (target.placement)")
    diff = np.argwhere(engine.table != plan.table)
    if len(diff):
        layer, slot = (int(x) for x in diff[0])
        raise PlacementMismatchError(
            f"{where}: MoE layer {layer} physical expert {slot} holds logical expert "
            f"{int(engine.table[layer, slot])} in the engine, the plan ({label}) writes expert "
            f"{int(plan.table[layer, slot])} there ({len(diff)} slots differ); nothing was "
            "written: replan for the engine's placement (planner.replan) and load that plan")
