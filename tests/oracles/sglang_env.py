"""Real SGLang 0.5.23 on CPU: its private install, and one engine rank's model over gloo.

SGLang's declared dependencies pull a CUDA torch 2.14, flashinfer, sgl-kernel and more;
none is needed to build its models on CPU. `install_sglang.sh` installs `sglang==0.5.23`
and the few packages its model-building import path loads (requirements-sglang.txt) with
`--no-deps --target SITE`, a folder outside the project's Python, so that triton and the
rest never change what the other tests (vLLM, Megatron-Core) import. Only processes that
call `prepare()` (the oracle and integration workers) see it.

What differs from a GPU engine, and why none of it changes the loaded values:
- `torchvision` is replaced by an empty stub module: the PyPI wheel links CUDA torch, and
  SGLang imports it only for image preprocessing (`InterpolationMode` at import time).
  `transformers` is imported first, so it still sees torchvision as absent.
- `setproctitle` (a C extension the scheduler, detokenizer and DP controller modules
  import; it only names the process) is a stub with no-op `setproctitle`/`getproctitle`.
- The parallel groups are built with SGLang's own `bootstrap._init_parallel_groups` over
  gloo (as `init_parallel_runtime` does), skipping only its CUDA device selection, NCCL
  warm-ups and the AMX thread binding that needs sgl-kernel.
- The model is built by SGLang's own `get_model` with `load_format="dummy"` (random
  values), then `model.load_weights(iter(hf_tensors))` loads the checkpoint as a real
  engine does; DeepSeek's `load_weights` ends with its `post_load_weights`.
"""

from __future__ import annotations

import enum
import importlib.machinery
import json
import os
import sys
import tempfile
import types
from typing import Any

VERSION = "0.5.23"
SITE = os.environ.get("RDMA_PLAN_SGLANG_SITE") or os.path.join(
    os.environ.get("RDMA_PLAN_CACHE") or os.path.expanduser("~/.cache/rdma-plan"),
    f"sglang-{VERSION}")
"""Where install_sglang.sh puts SGLang and its extra packages ($RDMA_PLAN_SGLANG_SITE, else
sglang-VERSION in $RDMA_PLAN_CACHE, default ~/.cache/rdma-plan)."""


def available() -> bool:
    """SGLang is installed in SITE (checked without importing it: the import takes ~30 s)."""
    return os.path.isfile(os.path.join(SITE, "sglang", "__init__.py"))


def _stub(name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def prepare() -> None:
    """Make SGLang importable in this process (see the module docstring)."""
    if SITE not in sys.path:
        sys.path.insert(0, SITE)
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cached as False before the stub exists
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        _stub(name, InterpolationMode=_InterpolationMode)
    if "setproctitle" not in sys.modules:
        _stub("setproctitle", setproctitle=lambda title: None, getproctitle=lambda: "")


def server_args(hf: dict, *, tp: int, pp: int = 1, ep: bool = False, dp: int = 1,
                dp_attention: bool = False, dtype: str = "float32") -> Any:
    """SGLang's ServerArgs for a folder holding `hf` as config.json (no weights)."""
    from sglang.srt.server_args import ServerArgs

    folder = tempfile.mkdtemp(prefix="sglang-oracle-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    return ServerArgs(model_path=folder, device="cpu", tp_size=tp, pp_size=pp, dtype=dtype,
                      load_format="dummy", skip_tokenizer_init=True,
                      disable_cuda_graph=True, ep_size=tp if ep else 1,
                      dp_size=dp, enable_dp_attention=dp_attention)


def init_world(rank: int, world: int, port: int) -> None:
    """The process-wide gloo WORLD (once per process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)


def build(args: Any, rank: int) -> Any:
    """Publish `args` for world rank `rank`, build SGLang's groups and its model (dummy
    weights). Call `teardown()` before building another engine in this process."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    bootstrap._init_parallel_groups(backend="gloo", server_args=args, gpu_id=rank,
                                    dist_init_method="env://")
    return build_model_only(args, rank, init_layers=True)


def build_model_only(args: Any, rank: int, init_layers: bool = False) -> Any:
    """Another model of the engine `build` set up (same rank, same groups)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_loader import get_model

    config = ModelConfig.from_server_args(args)
    if init_layers:
        bootstrap.init_layer_runtime(model_config=config)
    return get_model(model_config=config, load_config=LoadConfig(load_format="dummy"),
                     device_config=DeviceConfig(device="cpu", gpu_id=rank))


def teardown() -> None:
    from sglang.srt.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
