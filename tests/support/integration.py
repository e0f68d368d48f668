"""Shared by the integration tests: a module tree of given parameters, a stand-in for
Megatron's `parallel_state`, a small plan compiled from an HF config, a stand-in for
vLLM's weight-sync client that records the trainer's calls, and the rank processes of
tests/integrations/worker.py (`worker_env`, `start_worker`, `run_workers`)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from types import SimpleNamespace

import torch
import yaml

from harness.launch import Finished, root_env, spawn_ranks
from planner.compiler import compile_config
from planner.validate import load
from schemas.chunked_plan import write_chunked
from schemas.plan_write import write_plan

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "integrations", "worker.py")
"""The integration tests' rank process; its one argument is its job as JSON (role, index,
plan, config, store, ...)."""


def worker_env(**extra: str) -> dict[str, str]:
    """A worker's environment: the repository first on `PYTHONPATH`, a fresh job secret,
    NIXL's log quiet, one OpenMP thread, Python's warnings off, and `extra`."""
    return root_env(RDMA_PLAN_SECRET=secrets.token_hex(32), NIXL_LOG_LEVEL="WARN",
                    OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def start_worker(job: dict, env: dict[str, str]) -> subprocess.Popen:
    """A worker process of `job`, its stdout and stderr merged into one text pipe."""
    return subprocess.Popen([sys.executable, WORKER, json.dumps(job)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_workers(jobs: list[dict], timeout: float = 400.0, **env: str) -> list[Finished]:
    """One worker a job, all at once (`worker_env(**env)`), awaited together at most
    `timeout` seconds (`harness.launch.spawn_ranks`); each one's exit status and output, in
    the jobs' order."""
    return spawn_ranks(lambda r: [sys.executable, WORKER, json.dumps(jobs[r])], len(jobs),
                       env=worker_env(**env), timeout=timeout)


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
