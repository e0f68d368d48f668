"""A vLLM worker in the plan's terms: its identity, and whether its runtime tensors are the
ones the plan writes (checked at `init_transfer_engine`, before anything is registered).

- Identity from vLLM's own objects: the DP index and the TP/PP ranks in the model-parallel
  groups (vLLM's grid is `rank = (pp*PCP + pcp)*TP + tp`), expert placement from each MoE
  layer's `moe_config.moe_parallel_config` (the process-wide EP group can disagree). The
  plan rank is the one whose recorded identity equals it (`schemas.identity.find_rank`);
  vocab rows (`VocabParallelEmbedding.shard_indices`) are compared with the plan's.
- Runtime layouts: a tensor the plan writes must still be the live storage the engine
  computes with after its post-load processing (PWAL). Refused, naming the layer and the
  backend: a parameter PWAL removed or reshaped (CPU GEMM packing, AMX MLA), an MoE backend
  whose `w13` order differs from the plan's `target.w13_order` or that repacks experts, and
  MLA `W_UK_T`/`W_UV` that are copies of `kv_b_proj` but not in the plan's `derived` list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from integrations.errors import EngineMismatchError
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.plan import STAGING

MOE_W13_ORDER = {"TRITON": "w1w3", "BATCHED_TRITON": "w1w3", "FLASHINFER_CUTLASS": "w3w1",
                 "CPU": "w1w3"}
"""`w13_weight` order each unquantized MoE backend computes with after PWAL (vLLM 0.33,
`convert_to_unquantized_kernel_format`). CPU keeps the loader's order only where vLLM's
`_C` cannot prepack (no `prepack_moe_weight` op); the others (AITER shuffles, TRT-LLM and
MoonEP re-lay out, XPU transposes) are not targeted by any plan."""


def _cpu_moe_prepacks() -> bool:
    return hasattr(torch.ops._C, "prepack_moe_weight")


def worker_identity(vllm_config: Any) -> dict[str, int | str]:
    """This worker's coordinates, from vLLM's parallel state (call inside its process)."""
    from vllm.distributed import get_pp_group, get_tp_group

    pc = vllm_config.parallel_config
    return {"framework": "vllm", "index": pc.data_parallel_index * pc.world_size + pc.rank,
            "replica": 0, "dp": pc.data_parallel_index, "tp": get_tp_group().rank_in_group,
            "pp": get_pp_group().rank_in_group, "ep": 0,
            "tp_size": pc.tensor_parallel_size, "pp_size": pc.pipeline_parallel_size}


def plan_identity(header: PlanHeader, identity: dict[str, int | str]) -> dict[str, int | str]:
    """This worker's identity in the plan's terms (`schemas/identity.py`: replica, dp, tp,
    pp, ep): vLLM's global DP index is `replica * target.dp + dp`."""
    engine_dp = int(header.target.dp)
    return {"framework": "vllm", "replica": int(identity["dp"]) // engine_dp,
            "dp": int(identity["dp"]) % engine_dp, "tp": int(identity["tp"]),
            "pp": int(identity["pp"]), "ep": int(identity["ep"])}


def find_plan_rank(header: PlanHeader, identity: dict[str, int | str],
                   path: str = "plan") -> int:
    """This worker's plan rank: the one whose recorded identity equals `plan_identity`
    (`schemas.identity.find_rank`, which refuses an identity no rank holds, naming it).
    Refuses first a worker whose engine's TP/PP sizes differ from the plan's, which the
    coordinates alone need not show."""
    check_sizes(header, identity)
    return int(find_rank(header, plan_identity(header, identity), path))


def check_sizes(header: PlanHeader, identity: dict[str, int | str]) -> None:
    """Refuse a worker whose engine's TP/PP sizes differ from the plan's, which the
    coordinates alone need not show."""
    t = header.target
    wrong = [f"{k} {identity[k]} (plan {v})" for k, v in (("tp_size", int(t.tp)),
                                                          ("pp_size", int(t.pp)))
             if int(identity[k]) != v]
    if wrong:
        raise EngineMismatchError(
            f"vLLM worker {identity['index']}: {', '.join(wrong)}; start vLLM with the "
            f"parallel sizes the plan was compiled for (target tp {t.tp}, pp {t.pp}, dp "
            f"{t.dp}, ep {t.ep}) or compile a plan for this engine")


def moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "moe_config") and hasattr(m, "w13_weight")]


def check_experts(model: torch.nn.Module, header: PlanHeader,
                  identity: dict[str, int | str]) -> int:
    """Expert placement and runtime `w13` order of every MoE layer; returns this worker's
    `ep` coordinate (0 without EP)."""
    t = header.target
    group = int(t.dp) * int(t.tp)
    rank = int(identity["dp"]) % int(t.dp) * int(t.tp) + int(identity["tp"])
    want = (group, rank, 1, 0) if t.ep else (1, 0, group, rank)
    order = t.w13_order
    ep = 0
    for name, layer in moe_layers(model):
        mp = layer.moe_config.moe_parallel_config
        got = (mp.ep_size, mp.ep_rank, mp.tp_size, mp.tp_rank)
        if got != want:
            raise EngineMismatchError(
                f"{name}: vLLM places experts with ep_size/ep_rank/tp_size/tp_rank {got}, the "
                f"plan {want}; start vLLM with enable_expert_parallel={t.ep} as compiled")
        ep = mp.ep_rank
        qm = layer.quant_method
        backend = getattr(getattr(qm, "unquantized_backend", None), "name", None)
        if backend is None:
            raise EngineMismatchError(
                f"{name}: MoE method {type(qm).__name__} re-lays experts out after loading in "
                "a way no plan targets (quantized MoE kernels); serve the experts unquantized "
                "(triton or flashinfer_cutlass) for rdma_plan")
        runs = MOE_W13_ORDER.get(backend)
        if backend == "CPU" and _cpu_moe_prepacks():
            runs = None
        if runs != order:
            fix = (f"compile with target.w13_order: {runs}" if runs else
                   "choose moe_backend triton or flashinfer_cutlass")
            raise EngineMismatchError(
                f"{name}: MoE backend {backend} computes with w13 in "
                f"{runs or 'a repacked layout'}, the plan writes {order}; {fix}")
    return ep


def _vocab_rows(vocab: int, tp: int, t: int) -> tuple[int, int]:
    """`planner/layouts/vllm.py`'s rule: pad to 64, `per = padded/tp` rows per rank."""
    per = -(-vocab // 64) * 64 // tp
    return min(t * per, vocab), min((t + 1) * per, vocab)


def check_vocab_rows(model: torch.nn.Module, header: PlanHeader,
                     identity: dict[str, int | str]) -> None:
    vocab = header.model.vocab
    want = _vocab_rows(vocab, int(header.target.tp), int(identity["tp"]))
    for name, m in model.named_modules():
        si = getattr(m, "shard_indices", None)
        if si is None or getattr(m, "org_vocab_size", None) != vocab:
            continue
        got = (si.org_vocab_start_index, si.org_vocab_end_index)
        if got != want:
            raise EngineMismatchError(
                f"{name}: vLLM holds vocab rows [{got[0]}, {got[1]}), the plan writes "
                f"[{want[0]}, {want[1]}) for TP rank {identity['tp']}; compile for this engine")


def zero_vocab_padding(model: torch.nn.Module) -> int:
    """Zero the padding rows of every vocab-parallel weight, as vLLM's loader leaves them
    (`weight_loader`: rows past the checkpoint's fill with 0). No plan writes padding, so an
    engine started with dummy weights would otherwise keep random rows there. Returns rows."""
    rows = 0
    for m in model.modules():
        si, w = getattr(m, "shard_indices", None), getattr(m, "weight", None)
        if si is not None and isinstance(w, torch.Tensor) and w.dim() == 2:
            with torch.no_grad():
                w[si.num_org_elements:].zero_()
            rows += w.shape[0] - si.num_org_elements
    return rows


def check_tensors(model: torch.nn.Module, regions: list[Any],
                  tensors: dict[str, torch.Tensor]) -> None:
    """Every plan tensor is a live tensor of the plan's shape and dtype after PWAL."""
    problems = []
    for r in regions:
        t = tensors.get(r.name)
        if r.name == STAGING or (t is not None and tuple(t.shape) == tuple(r.shape)
                                   and str(t.dtype).removeprefix("torch.") == r.dtype):
            continue
        layer = r.name.rsplit(".", 1)[0]
        try:
            qm = type(getattr(model.get_submodule(layer), "quant_method", None)).__name__
        except AttributeError:
            qm = "no such module"
        got = "missing" if t is None else f"{str(t.dtype).removeprefix('torch.')} " \
                                          f"{list(t.shape)}"
        problems.append(f"{layer} ({qm}): {r.name} is {got} after post-load processing, the "
                        f"plan writes {r.dtype} {list(r.shape)}")
    if problems:
        raise EngineMismatchError(
            f"{len(problems)} tensor(s) were re-laid out by vLLM's post-load processing in a "
            f"way the plan does not target (e.g. CPU GEMM packing); first: {problems[0]}; "
            "use a backend that keeps the loaded weights")


def mla_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """MLAAttention modules by the prefix that owns their `kv_b_proj` (`...self_attn`)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(m.kv_b_proj)].removesuffix(".kv_b_proj"): m
            for m in model.modules() if hasattr(m, "W_UK_T") and hasattr(m, "kv_b_proj")}


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def refreshers(model: torch.nn.Module, entries: list[dict[str, Any]], act_dtype: torch.dtype
               ) -> list[tuple[str, Callable[[], None]]]:
    """One refresh per `derived` entry of this rank; refuses MLA copies the plan omits."""
    mla = mla_modules(model)
    listed = {e["module"] for e in entries if e["rule"] == "mla_absorb"}
    for prefix, m in mla.items():
        views = all(_same_storage(getattr(m, a), m.kv_b_proj.weight)
                    for a in ("W_UK_T", "W_UV"))
        if prefix not in listed and not views:
            raise EngineMismatchError(
                f"{prefix}: MLA W_UK_T/W_UV are copies of kv_b_proj (impl "
                f"{type(m.impl).__name__}) that the plan does not refresh; compile the plan "
                "for this kv_b_proj dtype or use an MLA backend that keeps them views")
    out = []
    for e in entries:
        if e.get("engine") != "vllm" or e["rule"] != "mla_absorb" or e["module"] not in mla:
            raise EngineMismatchError(f"plan derived entry {e!r}: no such rule or module in "
                                      "this vLLM model; compile the plan for this model")
        m = mla[e["module"]]
        out.append((e["module"], lambda m=m: m.process_weights_after_loading(act_dtype)))
    return out
