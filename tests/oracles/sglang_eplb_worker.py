"""One rank of SGLang 0.5.23's own EPLB rearrangement on CPU against a refit with a
replanned plan.

argv[1] is JSON: {"port": ...}. Over gloo (2 ranks: SGLang TP 2 with expert parallelism,
12 physical slots for the tiny Qwen3-MoE's 8 experts), each rank:

1. compiles plan A for a placement with redundant experts (FSDP2 dp 2 -> SGLang), and plan
   B for another by `planner.replan` (checked equal to B's full compile);
2. runs plan A locally from random HF tensors: this rank's stacked experts as the engine
   holds them for A;
3. moves them to placement B with SGLang's own `update_expert_weights_single_layer` (the
   per-layer body of `ExpertLocationUpdater.update`: its P2P sends and receives over the EP
   group, gloo here, and its buffer copies), layer by layer;
4. checks, bit for bit, that they equal what plan B writes from the same HF tensors.

Exits non-zero with the differences. SGLang's model object is not built here: its
`ExpertLocationUpdater.update` only wraps this function with the process-wide metadata
and a device cache flush; the layout of those stacked tensors is checked against SGLang's
model in test_sglang_oracle.py.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.oracles import sglang_env  # noqa: E402

sglang_env.prepare()

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    import torch.distributed as dist
    from sglang.srt.eplb.expert_location_updater import update_expert_weights_single_layer

    from harness.weights import random_full_tensors
    from planner.compiler import compile_config
    from planner.frameworks import build_layout
    from planner.layouts.vllm_rank import eplb_layers
    from planner.replan import replan
    from planner.spec import load_spec
    from planner.validate import validate
    from schemas.config_load import config_from_dict
    from schemas.placement import Placement
    from schemas.plan_write import encode_plan, write_plan
    from tests.support.local_refit import refit_locally

    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=arg["init"],
                            rank=rank, world_size=world)
    models = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")

    def config(table: np.ndarray):  # noqa: ANN202
        cfg = config_from_dict({"model": {"config": "tiny-qwen3-moe/config.json"},
                                "source": {"framework": "fsdp2", "dp": 2},
                                "target": {"engine": "sglang", "tp": world, "ep": True,
                                           "placement": {"physical_to_logical_map":
                                                         table.tolist()}},
                                "cluster": {"gpus_per_host": 8},
                                "options": {"write_overhead_us": 0.0}}, base_dir=models)
        spec = load_spec(cfg.model_config_path)
        validate(cfg, spec)
        return cfg, spec

    slots, experts = 12, 8
    rng = np.random.default_rng(6)
    _, spec = config(np.array([np.r_[np.arange(experts), [0] * (slots - experts)]] * 4))
    layers = eplb_layers(spec.dims)
    a = np.array([rng.permutation(np.r_[np.arange(experts), rng.choice(experts, slots - experts)])
                  for _ in layers])
    b = a.copy()
    b[0] = np.roll(b[0], 5)  # every slot of the first MoE layer, across the EP ranks
    b[-1, [1, slots - 2]] = b[-1, [slots - 2, 1]]
    cfg_a, spec = config(a)
    plan_a = compile_config(cfg_a, spec)
    plan_b = replan(plan_a, spec, Placement(b))
    if encode_plan(plan_b) != encode_plan(compile_config(*config(b))):
        sys.exit("the replanned plan for B differs from B's full compile")
    folder = os.environ.get("TMPDIR", "/tmp")
    full = random_full_tensors(spec, seed=9)
    src = build_layout(spec, cfg_a.source)

    def refit(plan) -> dict[str, torch.Tensor]:  # noqa: ANN001
        path = os.path.join(folder, f"sglang-eplb-{os.getpid()}.rplan")
        write_plan(path, plan)
        got = refit_locally(path, src, build_layout(spec, cfg_a.target), full)[rank]
        os.remove(path)
        return got

    held, want = refit(plan_a), refit(plan_b)
    per = slots // world
    errors = []
    for m, layer in enumerate(layers):
        names = [next(n for n in held if n.startswith(f"model.layers.{layer}.")
                      and n.endswith(w)) for w in ("w13_weight", "w2_weight")]
        weights = [held[n] for n in names]
        update_expert_weights_single_layer(
            routed_experts_weights=weights, temp_buffers=[torch.empty_like(w) for w in weights],
            old_physical_to_logical_map=a[m].tolist(), new_physical_to_logical_map=b[m].tolist(),
            num_local_physical_experts=per, num_gpu_per_node=world, rank=rank,
            world_size=world)
        for n in names:
            if not torch.equal(held[n], want[n]):
                bad = sorted(set((held[n] != want[n]).nonzero()[:, 0].tolist()))
                errors.append(f"rank {rank} {n}: local slots {bad} differ")
    moved = int((a != b).sum())
    if errors:
        print("\n".join(errors), flush=True)
        sys.exit(1)
    print(f"rank {rank}: SGLang's rearrangement of {moved} moved slots equals plan B's refit",
          flush=True)


if __name__ == "__main__":
    main()
