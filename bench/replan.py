"""Replan time for an expert placement change (EPLB), in CPU seconds, against a full compile.

    python bench/replan.py            # DeepSeek-V3: 256 experts x 58 MoE layers, EP 32, 288 slots
    python bench/replan.py --tiny     # the tiny Qwen3-MoE, seconds
    python bench/replan.py --no-check # skip the full compile of each new placement
    python bench/replan.py --cold     # each share's replans start from the plan read back
                                      # from its bytes (the first builds every index)
    python bench/replan.py --fresh    # each share's replans in a new process that reads the
                                      # plan from its msgpack file (as an engine's would)

Compiles the plan for a placement with redundant experts (every logical expert once, then
the hottest of a random load again, shuffled per layer), then for each rebalance (a share of
the slots of every layer take other experts, replica counts kept valid) times `replan` in
CPU seconds (`resource.getrusage`, this process only; the first replan of the plan, which
builds the indexes of its target slots and source tensors, and the best of `--repeat`;
with `--cold` the plan is read back from its encoding before each rebalance, as a new
process reading the plan file does, so every share's first replan is a plan's first; with
`--fresh` the plan is written to a file once and each share replanned in a new Python
process that loads it with `load_plan`, its CPU seconds timed in that process) and,
unless `--no-check`, compiles the new placement in full and compares the bytes.
Prints one table row per rebalance.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.compiler import compile_config  # noqa: E402
from planner.layouts.vllm_rank import eplb_layers  # noqa: E402
from planner.replan import replan  # noqa: E402
from planner.spec import load_spec  # noqa: E402
from planner.validate import validate  # noqa: E402
from schemas.config_load import config_from_dict  # noqa: E402
from schemas.placement import Placement  # noqa: E402
from schemas.plan import load_plan, read_plan_from  # noqa: E402
from schemas.plan_write import encode_plan, write_plan  # noqa: E402

MODELS = os.path.join(ROOT, "plans", "models")
SCALES = {
    # model, source, target, cluster, physical slots
    "deepseek-v3": ("deepseek-v3", {"framework": "fsdp2", "dp": 32},
                    {"engine": "vllm", "tp": 1, "dp": 32, "ep": True},
                    {"hosts": 8, "gpus_per_host": 8, "nics_per_host": 8}, 288),
    "tiny": ("tiny-qwen3-moe", {"framework": "fsdp2", "dp": 2},
             {"engine": "vllm", "tp": 2, "ep": True}, {"gpus_per_host": 8}, 10),
}
OPTIONS = {"write_overhead_us": 0.0}
"""Every expert slot written directly (no gather of replicated boxes: `route`), the
condition under which a placement change is an edit of the plan (`planner/replan.py`)."""


def placement(num_experts: int, layers: int, slots: int, rng: np.random.Generator) -> np.ndarray:
    rows = []
    for _ in range(layers):
        load = rng.pareto(1.5, num_experts)
        hot = np.argsort(-load)[: slots - num_experts]
        rows.append(rng.permutation(np.concatenate([np.arange(num_experts), hot])))
    return np.array(rows)


def rebalance(table: np.ndarray, share: float, num_experts: int,
              rng: np.random.Generator) -> np.ndarray:
    """`share` of each layer's slots swapped pairwise (every expert keeps a slot)."""
    out = table.copy()
    for row in out:
        k = max(2, int(share * len(row)) // 2 * 2)
        pick = rng.choice(len(row), k, replace=False)
        row[pick] = row[np.roll(pick, 1)]
        missing = np.flatnonzero(np.bincount(row, minlength=num_experts) == 0)
        spare = [s for s in pick if np.bincount(row, minlength=num_experts)[row[s]] > 1]
        for e, s in zip(missing, spare):
            row[s] = e
    return out


def config(scale: str, table: np.ndarray):
    model, source, target, cluster, _ = SCALES[scale]
    cfg = config_from_dict({"model": {"config": f"{model}/config.json", "mtp": False},
                            "source": source, "target": {**target, "placement": {
                                "physical_to_logical_map": table.tolist()}},
                            "cluster": cluster, "options": OPTIONS}, base_dir=MODELS)
    spec = load_spec(cfg.model_config_path, cfg.model.num_layers, cfg.model.overrides,
                     cfg.model.mtp)
    validate(cfg, spec)
    return cfg, spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--shares", default="0.02,0.1,0.5")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--replan-file", nargs=2, metavar=("PLAN", "PLACEMENT"),
                    help=argparse.SUPPRESS)  # (the child process of --fresh)
    args = ap.parse_args()
    scale = "tiny" if args.tiny else "deepseek-v3"
    if args.replan_file:
        _replan_file(scale, *args.replan_file, args.repeat)
        return
    tmp = tempfile.TemporaryDirectory(prefix="replan-") if args.fresh else None
    rng = np.random.default_rng(0)
    table = placement(*_dims(scale), rng)
    cfg, spec = config(scale, table)
    d = spec.dims
    c0, t0 = time.process_time(), time.perf_counter()
    plan = compile_config(cfg, spec)
    full_cpu, full_wall = time.process_time() - c0, time.perf_counter() - t0
    print(f"{scale}: {len(eplb_layers(d))} MoE layers x {SCALES[scale][4]} slots "
          f"({d.num_experts} experts), {plan.header.sources} sources -> "
          f"{plan.header.targets} targets, {plan.header.stats.writes:,} writes; full compile "
          f"{full_cpu:.1f} s CPU ({full_wall:.1f} s wall)")
    print("| slots moved (share) | writes touched | replan CPU s (first, best) | replan wall s "
          "| full compile CPU s | bytes equal |")
    print("|---|---:|---:|---:|---:|---|")
    for share in (float(x) for x in args.shares.split(",")):
        new = rebalance(table, share, d.num_experts, rng)
        moved = len(Placement(table).moved(Placement(new)))
        if args.cold:
            plan = read_plan_from(io.BytesIO(encode_plan(plan)), "plan")
        cpus, walls = [], []
        if tmp is not None:
            cpus, walls = _fresh(tmp.name, plan, new, args)
        for _ in range(max(1, args.repeat) if tmp is None else 1):
            gc.collect()
            c0, t0 = _cpu(), time.perf_counter()
            got = replan(plan, spec, Placement(new))
            if tmp is None:
                cpus.append(_cpu() - c0)
                walls.append(time.perf_counter() - t0)
        touched = sum(int((a.writes["src_region"] != b.writes["src_region"]).sum())
                      for a, b in zip(plan.ranks, got.ranks))
        equal, full = "not checked", "-"
        if not args.no_check:
            c0 = time.process_time()
            ref = compile_config(*config(scale, new))
            full = f"{time.process_time() - c0:.1f}"
            equal = str(encode_plan(ref) == encode_plan(got))
            del ref
        print(f"| {moved:,} ({share:.0%}) | {touched:,} | {cpus[0]:.3f}, {min(cpus):.3f} | "
              f"{min(walls):.3f} | {full} | {equal} |", flush=True)
        if equal == "False":
            sys.exit(1)


def _fresh(folder: str, plan, new: np.ndarray,
           args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The CPU and wall seconds of each of `--repeat` replans of `plan` (written to a file
    in `folder` once) for placement `new`, in a new process reading the plan file."""
    path, table = os.path.join(folder, "plan.msgpack"), os.path.join(folder, "new.npy")
    if not os.path.exists(path):
        write_plan(path, plan)
    np.save(table, new)
    argv = [sys.executable, os.path.abspath(__file__), "--replan-file", path, table,
            "--repeat", str(args.repeat), *(["--tiny"] if args.tiny else [])]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    return got["cpu"], got["wall"]


def _replan_file(scale: str, path: str, table: str, repeat: int) -> None:
    """`--fresh`'s child: the plan at `path` replanned for the placement in `table`."""
    spec = load_spec(os.path.join(MODELS, SCALES[scale][0], "config.json"), mtp=False)
    plan, new = load_plan(path), Placement(np.load(table))
    cpus, walls = [], []
    for _ in range(max(1, repeat)):
        gc.collect()
        c0, t0 = _cpu(), time.perf_counter()
        replan(plan, spec, new)
        cpus.append(_cpu() - c0)
        walls.append(time.perf_counter() - t0)
    print(json.dumps({"cpu": cpus, "wall": walls}))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _dims(scale: str) -> tuple[int, int, int]:
    model = SCALES[scale][0]
    spec = load_spec(os.path.join(MODELS, model, "config.json"), mtp=False)
    return spec.dims.num_experts, len(eplb_layers(spec.dims)), SCALES[scale][4]


if __name__ == "__main__":
    main()
