"""Megatron-Core adapter: the live model chunks -> plan rank, identity and tensors.

    from megatron.core import parallel_state
    b = integrations.megatron.bind("plan.rplan", model)   # model: the list of model chunks
    plan = executor.load("plan.rplan", rank=b.rank, tensors=b.tensors, identity=b.identity,
                         rendezvous=..., secret=...)

What it does:
- identity from `parallel_state`: `tp, pp, dp, ep, etp, edp` ranks and `vpp` = the number
  of virtual pipeline chunks (`get_virtual_pipeline_model_parallel_world_size()`, 1 if
  unset); the plan rank is the one whose identity equals it (`schemas.identity.find_rank`).
- names: each chunk is unwrapped (`DistributedDataParallel`, `Float16Module`: `.module`)
  down to the `GPTModel`; its `named_parameters()` and `named_buffers()` keep Megatron's
  stage-local layer indices; with VPP chunk v's names get the prefix `model{v}.`. Trained
  buffers the plan lists (`mlp.router.expert_bias`) are bound like parameters.
- dtypes: the model's own parameters are bound (bf16 under mixed precision, where the
  optimizer holds fp32 masters): they are what the forward pass and inference use.
  `router.expert_bias` stays fp32: Megatron's router moves it back to fp32 (new storage) at
  its first forward after `Float16Module` made it bf16; `bind` does that move first, so the
  bound storage is the one the router keeps using.
- refusals (`ModelMismatchError`, every problem at once, with the config key to change):
  Transformer Engine vs local names, grouped vs sequential experts, layers per stage or
  chunk, shapes, dtypes; an identity no plan rank has (`IdentityError`). A rank that holds
  no expert tensors (a dense model) is found by its `tp, pp, vpp, dp` alone: Megatron's
  expert coordinates (ETP=1 set for a dense model, say) select nothing there.

With `overlap_param_gather`, Megatron's bf16 parameters are all-gathered lazily at the next
forward: finish that gather (e.g. `model_chunk.start_param_sync(force_sync=True)`) before
`executor.run`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from schemas.chunked_plan import plan_header
from schemas.errors import IdentityError
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.tensors import rank_tensors

from . import Binding, ModelMismatchError, match

_LAYER = re.compile(r"^(model\d+\.)?decoder\.layers\.(\d+)\.")


def identity(parallel_state: Any = None) -> dict[str, int | str]:
    """This process's Megatron coordinates (`schemas/identity.py`) from `parallel_state`."""
    ps = parallel_state or _parallel_state()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {"framework": "megatron", "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(), "vpp": int(vpp or 1),
            "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}


def _parallel_state() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` inside DDP / Float16Module wrappers (each keeps it in `.module`)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def live_tensors(model: Any) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every parameter and buffer of the chunks under the plan's names (`model{v}.` with
    VPP), and the set of buffer names."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out: dict[str, torch.Tensor] = {}
    buffers: set[str] = set()
    for v, chunk in enumerate(chunks):
        m = unwrap(chunk)
        _fp32_expert_bias(m)
        pre = f"model{v}." if len(chunks) > 1 else ""
        for name, p in m.named_parameters():
            out[pre + name] = p.data
        for name, b in m.named_buffers():
            out[pre + name] = b
            buffers.add(pre + name)
    return out, buffers


def _fp32_expert_bias(model: torch.nn.Module) -> None:
    """`Float16Module` casts `router.expert_bias` to bf16 with everything else; the router
    puts it back to fp32 at its next forward by *replacing* the buffer's storage, which would
    leave the registered memory stale. Do that replacement now, once, before binding."""
    for mod in model.modules():
        keep = getattr(mod, "_maintain_float32_expert_bias", None)
        if callable(keep):
            keep()


def bind(plan_path: str, model: Any, parallel_state: Any = None) -> Binding:
    """Plan rank, identity and the exact tensors dict for this Megatron process."""
    ident = identity(parallel_state)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != ident["vpp"]:
        raise ModelMismatchError(f"model: {len(chunks)} model chunk(s) but parallel_state has "
                                 f"virtual_pipeline_model_parallel_size={ident['vpp']}; pass "
                                 "the whole list of model chunks")
    header = plan_header(plan_path)
    rank, ident = plan_rank(header, ident, plan_path)
    expected = rank_tensors(plan_path, rank)
    live, buffers = live_tensors(chunks)
    tensors = match(expected, live, plan_path, hint=lambda m, e: _hint(m, e, header),
                    ignore_extra=lambda n: n in buffers or ".mtp." in f".{n}")
    return Binding(rank=rank, identity=ident, tensors=tensors,
                   live=lambda h, path: plan_rank(h, identity(parallel_state), path))


def plan_rank(header: PlanHeader, ident: dict, path: str) -> tuple[int, dict[str, int | str]]:
    """The plan rank of this Megatron identity and the identity the plan records for it
    (a dense model's rank is found by its TP/PP/VPP/DP coordinates alone)."""
    try:
        return int(find_rank(header, ident, path)), ident
    except IdentityError:
        rank = _rank_without_experts(header, ident, path)
        return rank, dict(header.identities[rank])  # the expert coordinates select nothing


def live_rank(header: PlanHeader, path: str) -> tuple[int, dict[str, int | str]] | None:
    """(plan rank, identity) that this process's initialized Megatron `parallel_state`
    selects, or None where Megatron is not imported or its model parallel is not set up."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return plan_rank(header, identity(ps), path)


_GRID = ("tp", "pp", "vpp", "dp")
"""The coordinates that place a Megatron rank (`rank = tp + TP*(dp + DP*pp)`); `ep, etp,
edp` follow from them and the expert sizes, and matter only where a rank holds experts."""


def _rank_without_experts(header: PlanHeader, ident: dict, path: str) -> int:
    """The plan rank with this process's TP/PP/VPP/DP coordinates when it holds no expert
    tensors (a dense model, e.g. run with ETP=1 or EP>1 set for a dense model); otherwise
    the identity error for the full coordinates."""
    same = [r for r, i in enumerate(header.identities[:header.sources])
            if all(i.get(k) == ident[k] for k in _GRID)]
    if len(same) == 1 and not any(".experts." in f".{t.name}" for t in
                                  rank_tensors(path, same[0]).tensors):
        return same[0]
    return int(find_rank(header, ident, path))  # raises, naming the plan's parallel config


def _hint(missing: list[str], extra: list[str], header: PlanHeader) -> str:
    """The config key that most likely explains the name differences."""
    src = dataclasses.asdict(header.source) if header.source is not None else {}
    m, e = " ".join(missing), " ".join(extra)
    if "layer_norm_weight" in m or "layer_norm_weight" in e:
        te = "layer_norm_weight" in e
        return (f"the model {'uses' if te else 'does not use'} Transformer Engine names: set "
                f"source.transformer_engine: {str(te).lower()}")
    if "local_experts" in m + e and "linear_fc1.weight" in m + e:
        kind = "sequential" if "local_experts" in e else "grouped"
        return f"the model's experts are {kind}: set source.expert_layout: {kind}"
    layers_plan, layers_model = _layer_counts(missing), _layer_counts(extra)
    if layers_plan or layers_model:
        return (f"layers per chunk differ (plan-only layer indices {layers_plan}, model-only "
                f"{layers_model}; plan: pp={src.get('pp')} vpp={src.get('vpp')} "
                f"first/last stage layers {src.get('pp_first_stage_layers')}/"
                f"{src.get('pp_last_stage_layers')}): set source.pp_first_stage_layers / "
                "pp_last_stage_layers / vpp as the model was built")
    return ""


def _layer_counts(names: list[str]) -> dict[str, list[int]]:
    out: dict[str, set[int]] = {}
    for n in names:
        m = _LAYER.match(n)
        if m:
            out.setdefault(m.group(1) or "", set()).add(int(m.group(2)))
    return {k or "model": sorted(v) for k, v in out.items()}
