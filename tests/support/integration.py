"""Shared by the integration tests: a module tree of given parameters, a stand-in for
Megatron's `parallel_state`, a small plan compiled from an HF config, and a stand-in for
vLLM's weight-sync client that records the trainer's calls."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import yaml

from planner.compiler import compile_config
from planner.validate import load
from schemas.chunked_plan import write_chunked
from schemas.plan_write import write_plan


def module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose `named_parameters()` are `tensors` (dotted names)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        m = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def state(tp=0, pp=0, dp=0, ep=0, etp=0, edp=0, vpp=None):
    return SimpleNamespace(
        get_tensor_model_parallel_rank=lambda: tp, get_pipeline_model_parallel_rank=lambda: pp,
        get_data_parallel_rank=lambda: dp, get_expert_model_parallel_rank=lambda: ep,
        get_expert_tensor_parallel_rank=lambda: etp, get_expert_data_parallel_rank=lambda: edp,
        get_virtual_pipeline_model_parallel_world_size=lambda: vpp)


def compile_plan(tmp, hf: dict, source: dict, target: dict) -> tuple[str, str]:
    """(config path, plan path) of a small plan compiled in `tmp` (a chunked plan when
    `target` has `shadow: {budget_bytes: N}`)."""
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf, f)
    config = os.path.join(tmp, "c.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"model": {"config": "config.json", "mtp": False}, "source": source,
                        "target": target}, f)
    cfg, spec = load(config)
    plan = os.path.join(tmp, "p.rplan")
    compiled = compile_config(cfg, spec)
    if isinstance(compiled, list):
        write_chunked(plan, compiled, cfg.target.shadow.budget_bytes)
    else:
        write_plan(plan, compiled)
    return config, plan


class RecordingClient:
    """A stand-in for vLLM's weight-sync client as the trainer sender drives it: each call
    is only recorded (the test's own target process runs the plan's target rank)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, info: dict) -> None:
        self.calls.append("update")

    def finish_weight_update(self, version: str | None = None) -> None:
        self.calls.append("finish")
