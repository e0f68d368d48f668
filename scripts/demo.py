"""The main job on an embedded default: compile a plan and run it across processes.

    python3 scripts/demo.py [--config plans/demo.yaml] [--steps 3] [--transport nixl]

Compiles the config, starts one process per plan rank on this machine (sources hold
their shards of random weights, materialized from full logical tensors; targets start
from zeros), runs `--steps` steps with new weights each step over NIXL (UCX), and checks
after every step that every target tensor equals its reference bit-exactly. Prints
per-rank stats; exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(args: argparse.Namespace) -> int:
    import torch

    import executor
    from planner.layouts import build_layout
    from planner.materialize import materialize, random_full_tensors
    from planner.validate import load

    cfg, spec = load(args.config)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    rank, n_src = args.worker, src.world
    is_source = rank < n_src
    layout, local = (src, rank) if is_source else (dst, rank - n_src)
    shapes = {t.name: t for t in layout.ranks[local].tensors}
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    tensors = {n: torch.zeros(t.shape, dtype=dtypes[t.dtype]) for n, t in shapes.items()}
    plan = executor.load(args.plan, rank=rank, tensors=tensors, transport=args.transport,
                         rendezvous=f"127.0.0.1:{args.port}", timeout_s=60)
    report = {"rank": rank, "role": "source" if is_source else "target", "steps": []}
    # Each step's weights, made up front so that run() times the transfer, not the data.
    wants = [materialize(layout, random_full_tensors(spec, seed=1000 + step),
                         ranks=[local])[local] for step in range(args.steps)]
    received = sum(t.numel() * t.element_size() for t in tensors.values())
    for step in range(args.steps):
        want = wants[step]
        if is_source:  # the "training step": new weights, in place (memory stays registered)
            for name, t in tensors.items():
                t.copy_(want[name])
        stats = executor.run(plan)
        ok = None
        if not is_source:
            bad = [n for n, t in tensors.items() if not torch.equal(t, want[n])]
            ok = not bad
            if bad:
                report["mismatch"] = bad[:5]
        nbytes = stats.bytes if is_source else received
        report["steps"].append({"bytes": nbytes, "seconds": stats.seconds,
                                "gbps": nbytes / max(stats.seconds, 1e-9) / 1e9,
                                "bit_exact": ok})
    print(json.dumps(report), flush=True)
    return 0 if all(s["bit_exact"] in (None, True) for s in report["steps"]) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "plans", "demo.yaml"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--transport", default="nixl", choices=["nixl", "local"])
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return worker(args)

    from planner.compiler import compile_file
    from planner.inspect import inspect_text

    out = tempfile.mkdtemp(prefix="rdma-plan-demo-")
    plan = os.path.join(out, "demo.rplan")
    stats = compile_file(args.config, plan)
    print(f"compiled {args.config} -> {plan}: {stats['writes']} writes, {stats['bytes']:,} "
          f"bytes, {stats['plan_bytes']:,}-byte plan in {stats['seconds']:.2f} s")
    print(inspect_text(plan).split("\n\n")[0])
    with open(plan, "rb") as f:
        from schemas.plan import read_header

        world = read_header(f)[0]["world"]
    from tests.support.procs import free_port, root_env, spawn_ranks

    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--plan", plan,
           "--port", str(free_port()), "--steps", str(args.steps), "--transport",
           args.transport]
    t0 = time.perf_counter()
    done = spawn_ranks(lambda r: [*cmd, "--worker", str(r)], world, env=root_env(),
                       timeout=300, merge_stderr=False)
    failed = 0
    rows = []
    for f in done:
        line = f.output.strip().splitlines()[-1] if f.output.strip() else ""
        rep = json.loads(line) if line.startswith("{") else None
        if f.returncode != 0 or rep is None:
            failed += 1
            print(f"rank {f.rank}: FAILED (exit {f.returncode})")
            continue
        rows.append(rep)
    print("\nper rank and step: bytes sent (sources) or received (targets), time of run()")
    print(f"{'rank':>4} {'role':<7} " + " ".join(f"{'step ' + str(i):>22}"
                                              for i in range(args.steps)))
    for rep in rows:
        cells = [f"{s['bytes'] / 1e6:6.2f} MB {s['seconds'] * 1e3:7.1f} ms" for s in rep["steps"]]
        print(f"{rep['rank']:>4} {rep['role']:<7} " + " ".join(f"{c:>22}" for c in cells))
    exact = [s["bit_exact"] for rep in rows if rep["role"] == "target" for s in rep["steps"]]
    good = not failed and exact and all(exact)
    print(f"\n{len(rows)} ranks, {args.steps} steps over {args.transport} in "
          f"{time.perf_counter() - t0:.1f} s; target tensors bit-exact after every step: "
          f"{'yes' if good else 'NO'}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
