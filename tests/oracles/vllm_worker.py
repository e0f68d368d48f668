"""One rank of a real vLLM 0.33 engine on CPU, compared with our vLLM layout.

argv[1] is JSON: {"port": ..., "cases": [{"hf": {...}, "tp": 2, "pp": 1, "ep": false}]}.
For each case (tp*pp divides WORLD_SIZE; other ranks are external-DP copies): build
vLLM's model for this rank with `load_format="dummy"`, load random HF tensors through
`model.load_weights`, and compare every `named_parameters()` entry bit-exactly with
`materialize(layout, full)` for this rank (names and their order, shapes, dtypes,
values). Exits non-zero with the differences.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.support.engine_params import differences  # noqa: E402


def neutralise_cpu_gaps() -> None:
    """The spots that need CUDA or `vllm._C` on this path (see LAYOUTS.md), and vLLM's
    post-load processing: the tensors as `load_weights` left them
    (`tests.support.vllm_cpu_build.patch_cpu(post_load=False)`)."""
    from tests.support.vllm_cpu_build import patch_cpu

    patch_cpu(post_load=False)


def engine_config(hf: dict, tp: int, pp: int, ep: bool):  # noqa: ANN201 (vLLM's type)
    from vllm.engine.arg_utils import EngineArgs

    folder = tempfile.mkdtemp(prefix="vllm-oracle-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    return EngineArgs(model=folder, skip_tokenizer_init=True, dtype="float32",
                      load_format="dummy", tensor_parallel_size=tp,
                      pipeline_parallel_size=pp,
                      enable_expert_parallel=ep, enforce_eager=True,
                      max_model_len=128).create_engine_config()


KEEP: list[object] = []
"""Every case's model, alive until the worker exits: vLLM caches the PP-missing layer names
of a model by `id(model)` (`models/utils.py`), so a later model that reused a freed one's id
got the earlier model's list (a flaky KeyError in load_weights for deepseek_v3 pp2 after
qwen3_moe pp2)."""


def run_case(case: dict, rank: int) -> list[str]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    from harness.weights import materialize, random_full_tensors
    from planner.layouts import vllm as vllm_layout
    from planner.spec import spec_from_hf
    from schemas.config import TargetConfig

    spec = spec_from_hf(case["hf"], mtp=False)
    tp, pp = case["tp"], case.get("pp", 1)
    target = TargetConfig(engine="vllm", tp=tp, pp=pp, ep=case["ep"], dtype="float32")
    full = random_full_tensors(spec, seed=7)
    local = rank % (tp * pp)  # vLLM's rank grid: external DP x DP x PP x TP
    if case.get("layout") == "traced":  # traced on the meta device before this rank builds
        from planner.layouts import traced

        target = replace(target, layout="traced")
        layout = traced.layout(spec, target, case["hf"], tempfile.mkdtemp(prefix="trace-"))
    else:
        layout = vllm_layout.layout(spec, target)
    want = materialize(layout, full, ranks=[local])[local]
    cfg = engine_config(case["hf"], tp, pp, case["ep"])
    with set_current_vllm_config(cfg):
        initialize_model_parallel(tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp)
        try:
            model = get_model(vllm_config=cfg)
            KEEP.append(model)
            model.load_weights((k, v.view(spec.by_name[k].checkpoint_shape))
                               for k, v in full.items())
            got = {n: p.detach() for n, p in model.named_parameters()}
        finally:
            destroy_model_parallel()
    return [f"{case['name']} rank {rank}: {e}" for e in differences(got, want, "vLLM")]


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment

    neutralise_cpu_gaps()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=arg["init"],
                                     backend="gloo")
    errors = []
    for case in arg["cases"]:
        errors += run_case(case, rank)
        print(f"rank {rank}: {case['name']} done", flush=True)
    if errors:
        print("\n".join(errors[:50]), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
