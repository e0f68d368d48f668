"""Build a real vLLM 0.33 model on CPU with `tests.support.vllm_cpu_build`.

argv[1] is JSON: {"port", "hf", "folder"}. First the control: the same build without
`patch_cpu()` (its error is reported). Then `patch_cpu()`, `init_distributed`,
`engine_config`, `build_model` (dummy weights, vLLM's post-load run), `load_weights` of random
HF tensors and every `named_parameters()` entry compared bit for bit with our vLLM layout of
the same tensors (`materialize`); prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    arg = json.loads(sys.argv[1])
    import torch
    from vllm.config import set_current_vllm_config

    from harness.weights import materialize, random_full_tensors
    from planner.layouts import vllm as vllm_layout
    from planner.spec import spec_from_hf
    from schemas.config import TargetConfig
    from tests.support import vllm_cpu_build as cpu

    cpu.init_distributed(world_size=1, rank=0, init=arg["port"])
    cfg = cpu.engine_config(arg["folder"], tp=1, dtype="float32")
    try:
        cpu.build_model(cfg)
        control = "built without the patches"
    except Exception as e:  # noqa: BLE001  (the control's expected failure, reported)
        control = f"{type(e).__name__}: {e}"
    cpu.patch_cpu()
    cfg = cpu.engine_config(arg["folder"], tp=1, dtype="float32")  # fresh: layer names
    model = cpu.build_model(cfg)
    spec = spec_from_hf(arg["hf"], mtp=False)
    full = random_full_tensors(spec, seed=3)
    with set_current_vllm_config(cfg), torch.no_grad():
        model.load_weights((k, v.view(spec.by_name[k].checkpoint_shape))
                           for k, v in full.items())
    want = materialize(vllm_layout.layout(spec, TargetConfig(engine="vllm", tp=1,
                                                             dtype="float32")), full)[0]
    got = {n: p.detach() for n, p in model.named_parameters()}
    wrong = sorted(n for n in want if n not in got or got[n].shape != want[n].shape
                   or not torch.equal(got[n], want[n]))
    print("RESULT " + json.dumps({"control": control, "type": type(model).__name__,
                                  "compared": len(want), "names_equal": list(got) == list(want),
                                  "wrong": wrong}))


if __name__ == "__main__":
    main()
