"""One rank of a real vLLM 0.33 MoE model on CPU with EPLB: its rearrangement against a refit.

argv[1] is JSON: {"port": ..., "hf": {...}, "redundant": R, "out": folder}. Over gloo, TP 2
with expert parallelism (EP 2) and `enable_eplb` with R redundant experts, each rank:

1. builds vLLM's model (`load_format="dummy"`) and loads random HF tensors through
   `model.load_weights`: vLLM places every physical expert from its initial placement
   (`EplbState.build_initial_global_physical_to_logical_map`), step 1's placement A;
2. checks that a plan compiled for A (FSDP2 dp 2 -> this engine) writes, run locally
   from the same HF tensors, exactly this rank's `named_parameters()` (bit for bit);
3. moves the experts to placement B with vLLM's own `rearrange_expert_weights_inplace`
   over the EP group (gloo, `TorchDistGlooStagedEplbCommunicator`) and registers B's maps
   on the model (`set_eplb_state`, as `EplbState` does);
4. checks that the plan replanned for B (`planner.replan`, equal to B's full compile) writes
   exactly the rearranged weights, and that the backend check reads B from the model and
   refuses plan A in one line naming a layer and expert.

Exits non-zero with the differences.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def plans(hf: dict, a: np.ndarray, b: np.ndarray, folder: str):  # noqa: ANN201
    """Plans A and B (B replanned from A, checked equal to B's full compile), the spec and
    the layouts; written under `folder`."""
    from planner.compiler import compile_config
    from planner.replan import replan
    from planner.validate import validate
    from schemas.config_load import config_from_dict
    from schemas.placement import Placement
    from schemas.plan_write import encode_plan, write_plan

    def config(table: np.ndarray):  # noqa: ANN202
        from planner.spec import spec_from_hf

        cfg = config_from_dict({"model": {"config": "unused"},
                                "source": {"framework": "fsdp2", "dp": 2, "dtype": "float32"},
                                "target": {"engine": "vllm", "tp": 2, "ep": True,
                                           "dtype": "float32", "placement": {
                                               "physical_to_logical_map": table.tolist()}},
                                "cluster": {"gpus_per_host": 8},
                                "options": {"write_overhead_us": 0.0}})
        spec = spec_from_hf(hf, mtp=False)
        validate(cfg, spec)
        return cfg, spec

    cfg_a, spec = config(a)
    plan_a = compile_config(cfg_a, spec)
    plan_b = replan(plan_a, spec, Placement(b))
    full_b = compile_config(*config(b))
    if encode_plan(plan_b) != encode_plan(full_b):
        raise AssertionError("the replanned plan for B differs from B's full compile")
    paths = [os.path.join(folder, f"{n}.rplan") for n in "ab"]
    write_plan(paths[0], plan_a)
    write_plan(paths[1], plan_b)
    return cfg_a, config(b)[0], spec, paths, plan_a, plan_b


def refit(cfg, spec, path: str, full: dict, rank: int) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Target rank `rank`'s tensors after running plan `path` locally from `full`."""
    from planner.frameworks import build_layout
    from tests.support.local_refit import refit_locally

    return refit_locally(path, build_layout(spec, cfg.source), build_layout(spec, cfg.target),
                         full)[rank]


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    errors = [f"{what}: {n} missing in the refit" for n in got if n not in want]
    for name in got.keys() & want.keys():
        g, w = got[name], want[name]
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
            errors.append(f"{what}: {name} differs ({tuple(g.shape)} {g.dtype} vs "
                          f"{tuple(w.shape)} {w.dtype})")
    return errors


def set_placement(model: torch.nn.Module, table: np.ndarray, experts: int) -> None:
    """Register `table`'s maps on the model as `EplbState` does (`set_eplb_state`)."""
    layers, physical = table.shape
    l2p = torch.full((layers, experts, physical), -1, dtype=torch.int64)
    count = torch.zeros((layers, experts), dtype=torch.int64)
    for layer in range(layers):
        for slot, e in enumerate(table[layer].tolist()):
            l2p[layer, e, count[layer, e]] = slot
            count[layer, e] += 1
    load = torch.zeros((layers, physical), dtype=torch.int64)
    model.set_eplb_state(load, l2p, count)


def refused_in_one_line(check: Callable[[], object], what: str, said: str) -> list[str]:
    """`check()` (plan A on the engine in placement B) must raise `PlacementMismatchError` in
    one line naming a MoE layer and a logical expert, printed after `said`; the errors, each
    beginning with `what`, where it does not."""
    from integrations.errors import PlacementMismatchError

    try:
        check()
    except PlacementMismatchError as e:
        line = str(e)
        print(f"{said}: {line}", flush=True)
        if "\n" in line or "MoE layer" not in line or "logical expert" not in line:
            return [f"{what}: the refusal is not one line naming layer and expert: {line!r}"]
        return []
    return [f"{what}: plan A was not refused on the engine in placement B"]


def begin_update(path: str, plan_rank: int, model: torch.nn.Module) -> None:
    """An update of `path` begun by the vLLM backend's engine core on `model`."""
    from integrations import placement_check
    from integrations.engine_core import EngineCore
    from schemas.identity import plan_identity

    EngineCore(path, "vllm", lambda h: plan_identity(h, plan_rank, path),
               placement=lambda _: placement_check.vllm_placement(model),
               allow_unsigned=True).begin("v2")


def switch_checks(paths: list[str], plan_rank: int, model: torch.nn.Module) -> list[str]:
    """What an engine rank's plan switch (`integrations/engine_switch.py`, the vLLM
    backend's `rdma_plan_switch`) checks, on this model's EPLB maps after the
    rearrangement: plan A refused in one line naming layer and expert; plan B past every
    check up to the executor's (none is bound here: the switch itself runs in
    tests/integrations/test_engine_switch.py and live in tests/live/test_llm_offline.py)."""
    from executor.errors import PlanSwitchError
    from integrations import placement_check
    from integrations.engine_core import EngineCore
    from schemas.identity import plan_identity

    core = EngineCore(paths[0], "vllm", lambda h: plan_identity(h, plan_rank, paths[0]),
                      placement=lambda _: placement_check.vllm_placement(model),
                      allow_unsigned=True)
    errors = refused_in_one_line(
        lambda: core.check_switch(paths[0], 1, "rdma_plan worker"), "switch",
        f"plan rank {plan_rank}: switch refused")
    try:
        core.check_switch(paths[1], 1, "rdma_plan worker")
        errors.append("switch: no executor is bound, yet plan B was taken")
    except PlanSwitchError as e:
        if "no plan is bound" not in str(e):
            errors.append(f"switch: plan B refused before the executor's check: {e}")
    return errors


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.distributed.eplb.eplb_communicator import TorchDistGlooStagedEplbCommunicator
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    from harness.weights import random_full_tensors
    from integrations import placement_check
    from planner.layouts.vllm_rank import eplb_layers
    from planner.spec import spec_from_hf
    from schemas.placement import Placement
    from tests.support import vllm_cpu_build as cpu

    cpu.patch_cpu(post_load=False)
    torch.accelerator.current_stream = lambda *a, **k: type(  # no accelerator: nothing to sync
        "NoStream", (), {"synchronize": staticmethod(lambda: None)})()
    cpu.init_distributed(world, rank, arg["init"])
    hf, redundant = arg["hf"], arg["redundant"]
    folder = tempfile.mkdtemp(prefix="vllm-eplb-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    cfg = cpu.engine_config(folder, tp=world, ep=True, dtype="float32", rank=rank)
    # vLLM 0.33 refuses `enable_eplb` off CUDA/ROCm/XPU when it validates the parallel
    # config (a platform check, nothing else); set after validation, as that check passed
    cfg.parallel_config.enable_eplb = True
    cfg.parallel_config.eplb_config.num_redundant_experts = redundant
    cfg.parallel_config.eplb_config.communicator = "torch_gloo"
    spec = spec_from_hf(hf, mtp=False)
    experts, layers = spec.dims.num_experts, len(eplb_layers(spec.dims))
    initial = EplbState.build_initial_global_physical_to_logical_map(experts, redundant)
    a = np.array([initial] * layers)
    rng = np.random.default_rng(5)
    b = np.array([rng.permutation(np.concatenate([np.arange(experts),
                                                   rng.choice(experts, redundant)]))
                  for _ in range(layers)])
    errors: list[str] = []
    print(f"rank {rank}: config built", flush=True)
    with set_current_vllm_config(cfg):
        model = cpu.build_model(cfg)
        print(f"rank {rank}: model built", flush=True)
        full = random_full_tensors(spec, seed=9)
        full = {k: v.float() for k, v in full.items()}
        model.load_weights((k, v.view(spec.by_name[k].checkpoint_shape)) for k, v in full.items())
        set_placement(model, a, experts)
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        print(f"rank {rank}: loaded", flush=True)
        cfg_a, cfg_b, spec, paths, plan_a, plan_b = plans(hf, a, b, folder)
        print(f"rank {rank}: plans compiled", flush=True)
        errors += compare(got, refit(cfg_a, spec, paths[0], full, rank), "step 1 (placement A)")
        if placement_check.vllm_placement(model) != Placement(a):
            errors.append("the model's EPLB maps do not read back as placement A")

        weights = [list(layer.get_expert_weights()) for layer in
                   placement_check.moe_modules(model)]
        buffer = [torch.empty_like(w) for w in weights[0]]
        group = get_ep_group()
        rearrange_expert_weights_inplace(
            torch.tensor(a), torch.tensor(b), weights, buffer, group.device_group,
            TorchDistGlooStagedEplbCommunicator(group.cpu_group))
        print(f"rank {rank}: rearranged", flush=True)
        set_placement(model, b, experts)
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        errors += compare(got, refit(cfg_b, spec, paths[1], full, rank), "step 2 (placement B)")
        moved = sum(int(not torch.equal(got[n], p)) for n, p in
                    refit(cfg_a, spec, paths[0], full, rank).items() if "w13" in n or "w2" in n)
        if not moved:
            errors.append("placement B moved no expert of this rank: the test proves nothing")
        engine = placement_check.vllm_placement(model)
        if engine != Placement(b):
            errors.append("the model's EPLB maps do not read back as placement B")

        # what `start_weight_update` checks (the engine core's `begin`): the model's
        # placement against the plan's
        plan_rank = plan_a.header.sources + rank
        begin_update(paths[1], plan_rank, model)
        errors += refused_in_one_line(
            lambda: begin_update(paths[0], plan_rank, model),
            "start_weight_update", f"rank {rank}: refused")
        errors += switch_checks(paths, plan_a.header.sources + rank, model)
    if errors:
        print("\n".join(f"rank {rank}: {e}" for e in errors[:50]), flush=True)
        sys.exit(1)
    print(f"rank {rank}: ok ({moved} expert tensors changed by the rearrangement)", flush=True)


if __name__ == "__main__":
    main()
