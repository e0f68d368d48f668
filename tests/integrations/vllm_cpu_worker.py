"""One process: a vLLM 0.33 model and its `rdma_plan` engine on CPU through the shipped
`integrations.vllm_cpu` only (no test helpers), then the engine's init-time checks of a
plan compiled for it (`_plan_rank`, `check_tensors`). argv[1]: JSON {"model", "plan"}."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    arg = json.loads(sys.argv[1])
    from integrations import vllm_checks, vllm_cpu
    from integrations.vllm_content import live_tensors

    cfg = vllm_cpu.engine_config(arg["model"], tp=1)
    with vllm_cpu.model_parallel(cfg):
        model = vllm_cpu.build(cfg)
        engine = vllm_cpu.transfer_engine(cfg, model)
        header, part = engine._plan_rank(arg["plan"])
        vllm_checks.check_tensors(model, list(part.regions), live_tensors(model))
        print(f"built {type(model).__name__}, plan rank {engine.plan_rank}, "
              f"{len(part.regions)} regions checked; prepared {vllm_cpu.prepare()}", flush=True)


if __name__ == "__main__":
    main()
