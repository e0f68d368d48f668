"""Plans for an expert placement (EPLB) on the tiny Qwen3-MoE: FSDP2 dp 2 -> vLLM TP 2 with
expert parallelism, 10 physical slots for 8 experts; the tensors each rank binds."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from harness.weights import materialize, random_full_tensors
from planner.frameworks import build_layout
from planner.layouts.vllm_rank import eplb_layers
from planner.spec import ModelSpec, load_spec
from planner.validate import validate
from schemas.config import Config
from schemas.config_load import config_from_dict

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")
SLOTS = 10


def config(table: np.ndarray | None) -> tuple[Config, ModelSpec]:
    """The config (with `table` as `target.placement`; None: none) and the spec."""
    target: dict[str, Any] = {"engine": "vllm", "tp": 2, "ep": True}
    if table is not None:
        target["placement"] = {"physical_to_logical_map": np.asarray(table).tolist()}
    cfg = config_from_dict({"model": {"config": "tiny-qwen3-moe/config.json"},
                            "source": {"framework": "fsdp2", "dp": 2}, "target": target,
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
