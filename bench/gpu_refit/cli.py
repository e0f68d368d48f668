"""The parent process: compile the plans, launch one worker per GPU, render the results."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import tempfile
import time

from bench.gpu_refit.report import device_name, render_md, render_text, write_md
from bench.gpu_refit.run import worker
from bench.gpu_refit.setup import NO_MULTICAST, Setup
from harness.launch import free_port, root_env, spawn_ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny models on CPU: gloo instead of NCCL, nixl instead of cuda_ipc")
    p.add_argument("--tiny", action="store_true",
                   help="--cpu-dry-run in seconds: one tiny model, one step of each method")
    p.add_argument("--models", help="comma-separated model dirs under plans/models")
    p.add_argument("--transports", help="comma-separated executor transports; "
                   "cuda_ipc:N uses N copy streams (default executor.transports.cuda_ipc."
                   "STREAMS), cuda_ipc-raw posts copies one by one (no CUDA graphs), "
                   "cuda_ipc-engines keeps the copy engines (no copy kernel); nixl-nosgl posts "
                   "a put per write (no scatter-gather); -whole runs a stage's packs whole before "
                   "its writes (no pack groups); a "
                   "suffix @M keeps M batches in flight (default 8)")
    p.add_argument("--gpus", type=int, default=4,
                   help="4 (2 trainers, 2 inference), 2, or 1 (the 2-GPU ranks both on GPU 0; "
                   "no NCCL baseline)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-baseline", action="store_true", help="skip the NCCL baseline")
    p.add_argument("--baseline-steps", type=int, default=0, help="default: --steps")
    p.add_argument("--part-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=1024)
    p.add_argument("--floor-mib", type=int, default=4096, help="peer-copy buffer size")
    p.add_argument("--max-write-mib", type=int, default=0, help="compile option override")
    p.add_argument("--staging-mib", type=int, default=0,
                   help="compile option override: options.staging_bytes in MiB")
    p.add_argument("--fp8-cpu-check", type=int, default=1 << 27,
                   help="FP8 targets: elements per rank checked against the reference "
                   "quantizer on the CPU; the rest against it on the GPU")
    p.add_argument("--exec-timeout", type=float, default=120.0)
    p.add_argument("--plain-plan", action="store_true",
                   help="write the plans' blobs plain, not compact (to compare both forms' replay)")
    p.add_argument("--profile", action="store_true", help="torch profiler tables (GPU)")
    p.add_argument("--copy-microbench", action="store_true",
                   help="time 3 MiB peer copies by method (torch, foreach, cudaMemcpyAsync)")
    p.add_argument("--out", default=None, help="folder for results.json and section.md")
    p.add_argument("--process-per-model", action="store_true",
                   help="each model in its own worker processes, one model after another "
                   "(its floor measured there): a model's GPU memory, peers' mappings "
                   "included, goes with its processes; the results are merged")
    p.add_argument("--timeout", type=float, default=1500.0, help="whole run, seconds")
    p.add_argument("--render", help="results.json to render (no run)")
    p.add_argument("--write-md", help="replace the section in this markdown file")
    p.add_argument("--note", action="append", default=[],
                   help="with --render: a paragraph to add under the table (repeatable)")
    p.add_argument("--inject-failure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plans", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.cpu_dry_run = True
        args.models = args.models or "tiny-qwen3"
        args.steps, args.warmup, args.part_steps = 1, 0, 1
        args.baseline_steps, args.floor_mib = 1, min(args.floor_mib, 8)
        args.timeout = min(args.timeout, 300.0)
    dry = args.cpu_dry_run
    if args.gpus == 1:  # NCCL refuses two ranks on one device
        args.no_baseline = True
    args.models = (args.models or ("tiny-qwen3,tiny-qwen3-moe" if dry else
                                   "qwen3-8b,qwen3-30b-a3b")).split(",")
    args.transports = (args.transports or ("nixl" if dry else "cuda_ipc")).split(",")
    if dry:
        args.floor_mib = min(args.floor_mib, 64)
        args.bucket_mib = min(args.bucket_mib, 1)  # several buckets, as on GPU
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        args.plans = args.plans.split(",")
        return worker(args)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        results["notes"] = [*results.get("notes", []), *args.note]
        print(render_text(results))
        if args.write_md:
            write_md(args.write_md, render_md(results))
        return 0
    setup = Setup.for_gpus(args.gpus)
    plans, compile_info = compile_plans(args, setup)
    device = device_name(not args.cpu_dry_run)
    print(f"device: {device}", flush=True)
    out_dir = args.out or tempfile.mkdtemp(prefix="gpu-refit-")
    os.makedirs(out_dir, exist_ok=True)
    results_path = os.path.join(out_dir, "results.json")
    failed = (launch_each if args.process_per_model else launch)(args, argv, setup, plans,
                                                                 results_path)
    if not os.path.exists(results_path):
        print("no results", flush=True)
        return 1
    with open(results_path) as f:
        results = json.load(f)
    for m in results["models"]:  # the floor's bytes: what the plan writes into one GPU
        stats = compile_info[m["model"]]["rank_stats"]
        m["recv_bytes_max"] = max(stats[r]["bytes_in"] for r in setup.targets)
    shown = " ".join("$OUT" if a == args.out else a for a in argv)
    results.update(device=device, compile=compile_info, steps=args.steps, warmup=args.warmup,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command=f"PYTHONUNBUFFERED=1 python3 -m bench.gpu_refit {shown}".strip())
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    print("\n" + render_text(results), flush=True)
    with open(os.path.join(out_dir, "section.md"), "w") as f:
        f.write(render_md(results))
    if args.write_md:
        write_md(args.write_md, render_md(results))
    exact = [r.get("bit_exact") for m in results["models"] for r in m["methods"].values()]
    ok = not failed and exact and all(exact) and len(results["models"]) == len(args.models)
    print(f"results: {results_path}; all methods bit-exact: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def compile_plans(args: argparse.Namespace, setup: Setup) -> tuple[list[str], dict]:
    """Compile every model's plan into a temporary folder: the paths and compile stats."""
    from planner.compiler import compile_config
    from planner.spec import load_spec
    from planner.validate import validate
    from schemas.plan_write import write_plan

    work = tempfile.mkdtemp(prefix="gpu-refit-plans-")
    plans, compile_info = [], {}
    for model in args.models:
        cfg = setup.config(model, args.max_write_mib, args.staging_mib)
        spec = load_spec(cfg.model_config_path)
        validate(cfg, spec)
        t0 = time.perf_counter()
        plan = compile_config(cfg, spec)
        path = os.path.join(work, f"{model}.rplan")
        size = write_plan(path, plan, compact=not args.plain_plan)
        st = plan.header.stats
        rank_stats = [dataclasses.asdict(s) for s in plan.header.rank_stats]
        compile_info[model] = {"seconds": time.perf_counter() - t0, "plan_bytes": size,
                               "writes": st.writes, "bytes": st.bytes,
                               "packs": st.packs, "unpacks": st.unpacks,
                               "rank_stats": rank_stats}
        print(f"compiled {model}: {st.writes} writes, {st.bytes / 1e9:.2f} GB, "
              f"{st.packs} packs, {st.unpacks} unpacks, plan {size / 1e6:.2f} MB in "
              f"{compile_info[model]['seconds']:.2f} s; per rank: {rank_stats}", flush=True)
        plans.append(path)
    return plans, compile_info


def launch(args: argparse.Namespace, argv: list[str], setup: Setup, plans: list[str],
           results_path: str) -> list[tuple[int, int]]:
    """One worker process per GPU (this command again, with `--worker RANK`); the ranks
    that failed, as (rank, exit status)."""
    cmd = [sys.executable, "-m", "bench.gpu_refit", *argv, "--port", str(free_port()),
           "--plans", ",".join(plans), "--results", results_path,
           "--models", ",".join(args.models), "--transports", ",".join(args.transports)]
    t0 = time.perf_counter()
    done = spawn_ranks(lambda r: [*cmd, "--worker", str(r)], setup.world,
                       env=root_env(**NO_MULTICAST, RDMA_PLAN_SECRET=secrets.token_hex(32)),
                       timeout=args.timeout, capture=False)
    failed = [(f.rank, f.returncode) for f in done if f.returncode != 0]
    print(f"workers finished in {time.perf_counter() - t0:.1f} s; failed: {failed or 'none'}",
          flush=True)
    return failed


def launch_each(args: argparse.Namespace, argv: list[str], setup: Setup, plans: list[str],
                results_path: str) -> list[tuple[int, int]]:
    """`--process-per-model`: `launch` once a model, one after another; each model's
    results keep the floor its own workers measured (`floor`), and the merged file's floor
    is the first model's. The ranks that failed, as (rank, exit status), over all models."""
    merged: dict = {"floor": None, "models": []}
    failed: list[tuple[int, int]] = []
    for model, plan in zip(args.models, plans):
        part = f"{results_path}.{len(merged['models'])}"
        failed += launch(argparse.Namespace(**{**vars(args), "models": [model]}), argv, setup,
                         [plan], part)
        if not os.path.exists(part):
            print(f"{model}: no results", flush=True)
            continue
        with open(part) as f:
            one = json.load(f)
        for m in one["models"]:
            m["floor"] = one["floor"]
        merged["floor"] = merged["floor"] or one["floor"]
        merged["models"] += one["models"]
    with open(results_path, "w") as f:
        json.dump(merged, f, indent=1)
    return failed
