"""Plans for an expert placement (EPLB) on the tiny Qwen3-MoE: FSDP2 dp 2 -> vLLM TP 2 with
expert parallelism (or another dp and TP: 1 and 1, two ranks), 10 physical slots for 8
experts; the tensors each rank binds; the plans written to a folder and read back there by
each rank's process (`write_plans`, `read_plans`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.layouts.vllm_rank import eplb_layers
from planner.replan import replan
from planner.spec import ModelSpec, load_spec
from planner.validate import validate
from schemas.config import Config
from schemas.config_load import config_from_dict
from schemas.placement import Placement
from schemas.plan import Plan
from schemas.plan_write import write_plan

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")
SLOTS = 10


def config(table: np.ndarray | None, dp: int = 2, tp: int = 2) -> tuple[Config, ModelSpec]:
    """The config (with `table` as `target.placement`; None: none; FSDP2 `dp` sources, a
    vLLM engine of TP `tp` with expert parallelism) and the spec."""
    target: dict[str, Any] = {"engine": "vllm", "tp": tp, "ep": True}
    if table is not None:
        target["placement"] = {"physical_to_logical_map": np.asarray(table).tolist()}
    cfg = config_from_dict({"model": {"config": "tiny-qwen3-moe/config.json"},
                            "source": {"framework": "fsdp2", "dp": dp}, "target": target,
                            "cluster": {"gpus_per_host": 8},
                            "options": {"write_overhead_us": 0.0}}, base_dir=MODELS)
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    return cfg, spec


def tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Placements A and B: every expert once and two hot ones again, shuffled per layer; B
    moves every slot of the first MoE layer and swaps two of the last."""
    _, spec = config(None)
    d, rng = spec.dims, np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(d.num_experts),
                                            rng.choice(d.num_experts, SLOTS - d.num_experts)]))
            for _ in eplb_layers(d)]
    a = np.array(rows)
    b = a.copy()
    b[0] = np.roll(b[0], 1)
    b[-1, [0, -1]] = b[-1, [-1, 0]]
    return a, b


def rank_tensors(cfg: Config, spec: ModelSpec, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """What plan rank `rank` holds with the model's weights of `seed`: a source its shards,
    a target what the engine's layout for `cfg`'s placement holds (the refit's oracle)."""
    full = random_full_tensors(spec, seed=seed)
    src = build_layout(spec, cfg.source)
    if rank < src.world:
        return materialize(src, full, [rank])[rank]
    r = rank - src.world
    return materialize(build_layout(spec, cfg.target), full, [r])[r]


def write_plans(folder: str, dp: int = 2, tp: int = 2) -> tuple[Plan, Plan]:
    """Plans A and B of `tables(seed=4)` (B replanned from A) for FSDP2 dp `dp` -> vLLM TP
    `tp`, written under `folder` as a.rplan and b.rplan, with tables.npz (the placements,
    dp and tp: what `read_plans` gives each rank's process)."""
    a, b = tables(seed=4)
    cfg, spec = config(a, dp, tp)
    plan_a = compile_config(cfg, spec)
    plan_b = replan(plan_a, spec, Placement(b))
    write_plan(os.path.join(folder, "a.rplan"), plan_a)
    write_plan(os.path.join(folder, "b.rplan"), plan_b)
    np.savez(os.path.join(folder, "tables.npz"), a=a, b=b, dp=dp, tp=tp)
    return plan_a, plan_b


@dataclass(frozen=True)
class PlanFolder:
    """What `write_plans` left in a folder, as a rank's process reads it back."""

    path_a: str
    path_b: str
    a: Placement
    """Plan A's placement (the engine's before the rebalance)."""
    b: Placement
    """Plan B's placement (after it)."""
    cfg_a: Config
    cfg_b: Config
    spec: ModelSpec
    sources: int
    """The FSDP2 ranks (plan ranks 0 .. sources - 1); the engine's follow."""
    world: int


def read_plans(folder: str) -> PlanFolder:
    """The plans, placements, configs and world that `write_plans` wrote under `folder`."""
    t = np.load(os.path.join(folder, "tables.npz"))
    dp, tp = int(t["dp"]), int(t["tp"])
    (cfg_a, spec), (cfg_b, _) = config(t["a"], dp, tp), config(t["b"], dp, tp)
    return PlanFolder(os.path.join(folder, "a.rplan"), os.path.join(folder, "b.rplan"),
                      Placement(t["a"]), Placement(t["b"]), cfg_a, cfg_b, spec, dp, dp + tp)
