"""The main job on an embedded default: compile a plan and run it across processes.

    python3 scripts/demo.py [--config plans/demo.yaml] [--steps 3] [--transport nixl]

Compiles the config, starts one process per plan rank on this machine (sources hold
their shards of random weights, materialized from full logical tensors; targets start
from zeros), runs `--steps` steps with new weights each step over NIXL (UCX), and checks
after every step that every target tensor equals its reference bit-exactly. Prints
per-rank stats; exits 1 on any mismatch or error. `--transport local` runs every rank in
this process instead (one thread each, the in-process `local` transport).

The launcher draws the job secret once and hands it to every rank in its environment
(`RDMA_PLAN_SECRET`), as a real launcher would.
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


class Rank:
    """One rank's tensors (zeros) and each step's reference weights."""

    def __init__(self, config: str, rank: int, steps: int) -> None:
        import torch

        from planner.layouts import build_layout
        from planner.materialize import materialize, random_full_tensors
        from planner.validate import load

        cfg, spec = load(config)
        src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
        self.rank, self.is_source = rank, rank < src.world
        layout, local = (src, rank) if self.is_source else (dst, rank - src.world)
        dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float32": torch.float32}
        self.tensors = {t.name: torch.zeros(t.shape, dtype=dtypes[t.dtype])
                        for t in layout.ranks[local].tensors}
        # Each step's weights, made up front so that run() times the transfer, not the data.
        self.wants = [materialize(layout, random_full_tensors(spec, seed=1000 + step),
                                  ranks=[local])[local] for step in range(steps)]
        self.report: dict = {"rank": rank, "role": "source" if self.is_source else "target",
                             "steps": []}

    def before(self, step: int) -> None:
        if self.is_source:  # the "training step": new weights, in place (still registered)
            for name, t in self.tensors.items():
                t.copy_(self.wants[step][name])

    def after(self, step: int, stats) -> None:
        import torch

        ok = None
        if not self.is_source:
            bad = [n for n, t in self.tensors.items()
                   if not torch.equal(t, self.wants[step][n])]
            ok = not bad
            if bad:
                self.report["mismatch"] = bad[:5]
        self.report["steps"].append({"bytes": stats.bytes, "seconds": stats.seconds,
                                     "gbytes_per_s": stats.gbytes_per_s, "bit_exact": ok})

    def good(self) -> bool:
        return all(s["bit_exact"] in (None, True) for s in self.report["steps"])


def worker(args: argparse.Namespace) -> int:
    import executor

    me = Rank(args.config, args.worker, args.steps)
    plan = executor.load(args.plan, rank=me.rank, tensors=me.tensors, transport=args.transport,
                         rendezvous=f"127.0.0.1:{args.port}", timeout_s=60,
                         no_identity=True)  # the demo starts plan rank r as worker r
    for step in range(args.steps):
        me.before(step)
        me.after(step, executor.run(plan))
    print(json.dumps(me.report), flush=True)
    plan.close()
    return 0 if me.good() else 1


def in_process(args: argparse.Namespace, plan: str, world: int) -> tuple[list[dict], int]:
    """Every rank in this process over the `local` transport, one thread per rank."""
    import threading

    from executor import Executor
    from executor.transports.local import Fabric
    from schemas.plan import load_plan

    pf, fabric = load_plan(plan), Fabric()
    ranks = [Rank(args.config, r, args.steps) for r in range(world)]
    exs = [Executor(pf.header, pf.ranks[r], ranks[r].tensors, "local", fabric, timeout_s=60)
           for r in range(world)]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    errors: list[str] = []

    def one(r: int, step: int) -> None:
        try:
            ranks[r].after(step, exs[r].run())
        except Exception as e:  # noqa: BLE001 - reported, the demo fails
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
    for step in range(args.steps):
        for rk in ranks:
            rk.before(step)
        threads = [threading.Thread(target=one, args=(r, step)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    for e in errors:
        print(e)
    for ex in exs:
        ex.close()
    return [rk.report for rk in ranks], len(errors) + sum(not rk.good() for rk in ranks)


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

        world = read_header(f)[0].world
    t0 = time.perf_counter()
    if args.transport == "local":
        rows, failed = in_process(args, plan, world)
    else:
        rows, failed = processes(args, plan, world)
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


def processes(args: argparse.Namespace, plan: str, world: int) -> tuple[list[dict], int]:
    """One process per rank, over NIXL; the job secret drawn here, handed to every rank."""
    import secrets

    from tests.support.procs import free_port, root_env, spawn_ranks

    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--plan", plan,
           "--port", str(free_port()), "--steps", str(args.steps), "--transport",
           args.transport]
    done = spawn_ranks(lambda r: [*cmd, "--worker", str(r)], world,
                       env=root_env(RDMA_PLAN_SECRET=secrets.token_hex(32)), timeout=300,
                       merge_stderr=False)
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
    return rows, failed


if __name__ == "__main__":
    sys.exit(main())
