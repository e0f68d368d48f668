"""One rank of a real vLLM 0.33 engine on CPU loading a block-FP8 checkpoint.

argv[1] is JSON: {"port": ..., "out": folder, "quant": file,
"cases": [{"name": ..., "model": folder, "tp": 2}]}. Each case's model folder holds an HF
`config.json` with an fp8 block `quantization_config` and a `model.safetensors` written
by the test (e4m3 `weight` and float32 `weight_scale_inv` per 128x128 block). vLLM
builds the model for this rank with its fp8 linear/MoE methods and loads the file with
its own loader (`load_format="safetensors"`: DefaultModelLoader -> `model.load_weights`
-> the per-parameter weight loaders that shard weights and block scales). Rank r < tp
writes every `named_parameters()` entry, as loaded, to `<out>/<name>.rank<r>.safetensors`;
ranks past tp (vLLM external-DP copies) only join the process groups. Rank 0 also runs
vLLM's own block quantizer (`vllm.utils.deep_gemm.per_block_cast_to_fp8`, what its
`fp8_per_block` online method applies to each weight shard) on every tensor of the
`quant` file and writes `<out>/quant.safetensors` (`<name>` e4m3, `<name>_scale_inv`).

Three CPU gaps are neutralised, none on the loading path: `torch.accelerator.empty_cache`,
`process_weights_after_loading` (needs `vllm._C`; so tensors are captured exactly as
`load_weights` left them, before any kernel repacking), and `init_fp8_linear_kernel`
(CPU has no block-FP8 GEMM without AMX; the kernel is only used by forward).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.oracles.vllm_worker import neutralise_cpu_gaps  # noqa: E402


def run_case(case: dict, rank: int, out: str) -> None:
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    tp = case["tp"]
    cfg = EngineArgs(model=case["model"], skip_tokenizer_init=True, dtype="bfloat16",
                     load_format="safetensors", tensor_parallel_size=tp,
                     enforce_eager=True, max_model_len=128).create_engine_config()
    with set_current_vllm_config(cfg):
        initialize_model_parallel(tensor_model_parallel_size=tp)  # collective: every rank
        try:
            if rank < tp:
                model = get_model(vllm_config=cfg)
                params = {n: p.detach().contiguous() for n, p in model.named_parameters()}
                save_file(params, os.path.join(out, f"{case['name']}.rank{rank}.safetensors"))
        finally:
            destroy_model_parallel()


def run_quantizer(path: str, out: str) -> None:
    from safetensors.torch import load_file, save_file
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    result = {}
    for name, x in load_file(path).items():
        result[name], result[name + "_scale_inv"] = per_block_cast_to_fp8(x, [128, 128])
    save_file(result, os.path.join(out, "quant.safetensors"))


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment

    neutralise_cpu_gaps()  # init_fp8_linear_kernel too (tests.support.vllm_cpu_build)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=arg["init"],
                                     backend="gloo")
    if rank == 0 and arg.get("quant"):
        run_quantizer(arg["quant"], arg["out"])
    for case in arg["cases"]:
        run_case(case, rank, arg["out"])
        print(f"rank {rank}: {case['name']} done", flush=True)


if __name__ == "__main__":
    main()
