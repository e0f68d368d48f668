"""The main job on an embedded default: compile a plan and run it across processes.

    python3 scripts/demo.py [--config plans/demo.yaml] [--steps 3] [--transport nixl]
                            [--timeout-s 60]

Compiles the config, starts one process per plan rank on this machine (sources hold
their shards of random weights, materialized from full logical tensors; targets start
from zeros), runs `--steps` steps with new weights each step over NIXL (UCX), and checks
after every step that every target tensor equals its reference bit-exactly. Prints
per-rank stats; on any mismatch or error it says why (per step and rank: a timeout, another
error, or the tensors that differ, the first few by name) and exits 1; a step that fails is
recovered by the next. `--transport local` runs every rank in this process instead (one
thread each, the in-process `local` transport; a step starts once every rank's previous
one returned).

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

        from harness.weights import materialize, random_full_tensors
        from planner.frameworks import build_layout
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

        row = {"step": step, "bytes": stats.bytes, "seconds": stats.seconds,
               "gbytes_per_s": stats.gbytes_per_s, "bit_exact": None}
        if not self.is_source:
            bad = [n for n, t in self.tensors.items()
                   if not torch.equal(t, self.wants[step][n])]
            row.update(bit_exact=not bad, mismatch=bad[:5], mismatched=len(bad),
                       tensors=len(self.tensors))
        self.report["steps"].append(row)

    def failed(self, step: int, e: BaseException) -> None:
        """run() raised in `step`: the targets' weights of that step are not whole."""
        first = (str(e).splitlines() or [""])[0]
        self.report["steps"].append({
            "step": step, "bytes": 0, "seconds": 0.0, "gbytes_per_s": 0.0,
            "bit_exact": None if self.is_source else False,
            "error": f"{type(e).__name__}: {first[:300]}",
            "timed_out": isinstance(e, TimeoutError)})

    def good(self) -> bool:
        return all(s["bit_exact"] in (None, True) and "error" not in s
                   for s in self.report["steps"])


def why(rows: list[dict], limit: int = 8) -> list[str]:
    """Why the run is not bit-exact: per failed step and rank, a timeout, another error or
    the tensors that differ (the first few names), in step order."""
    out = []
    for rep in rows:
        for s in rep["steps"]:
            where = f"step {s['step']}, rank {rep['rank']} ({rep['role']})"
            if "error" in s:
                kind = "timed out" if s.get("timed_out") else "failed"
                out.append((s["step"], f"{where}: {kind}: {s['error']}"))
            elif s["bit_exact"] is False:
                out.append((s["step"], f"{where}: {s['mismatched']} of {s['tensors']} "
                            f"tensors differ: {', '.join(s['mismatch'])}"
                            + (", ..." if s["mismatched"] > len(s["mismatch"]) else "")))
        if "problem" in rep:
            out.append((1 << 30, f"rank {rep['rank']}: {rep['problem']}"))
    out.sort(key=lambda x: x[0])
    lines = [line for _, line in out[:limit]]
    if len(out) > limit:
        lines.append(f"... and {len(out) - limit} more")
    return lines


def worker(args: argparse.Namespace) -> int:
    import executor
    from schemas.plan import open_plan, read_header

    me = Rank(args.config, args.worker, args.steps)
    # This launcher starts plan rank r as worker r and hands it the coordinates the plan lists
    # for rank r; a real job's rank derives its own from its framework (integrations.megatron
    # .bind, integrations.fsdp2.bind), which is what makes the identity check worth having.
    with open_plan(args.plan) as f:
        identity = dict(read_header(f, args.plan)[0].identities[me.rank])
    plan = executor.load(args.plan, rank=me.rank, tensors=me.tensors, transport=args.transport,
                         rendezvous=f"127.0.0.1:{args.port}", timeout_s=args.timeout_s,
                         identity=identity)
    for step in range(args.steps):
        me.before(step)
        try:
            stats = executor.run(plan)
        except Exception as e:  # noqa: BLE001 - reported; the next run() recovers
            me.failed(step, e)
            continue
        me.after(step, stats)
    print(json.dumps(me.report), flush=True)
    plan.close()
    return 0 if me.good() else 1


STEP_LIMIT_S = 600
"""How long the in-process demo waits for a rank's step before it gives up on the run."""


def in_process(args: argparse.Namespace, plan: str, world: int) -> tuple[list[dict], int]:
    """Every rank in this process over the `local` transport, one thread per rank. A step
    starts only once every rank's previous step returned (its sources' new weights must not
    overwrite what a late rank still sends)."""
    import threading

    from executor import Executor
    from executor.transports.local import Fabric
    from schemas.plan import load_plan

    t0 = time.perf_counter()
    pf, fabric = load_plan(plan), Fabric()
    ranks = [Rank(args.config, r, args.steps) for r in range(world)]
    exs = [Executor(pf.header, pf.ranks[r], ranks[r].tensors, transport="local", rendezvous=fabric,
                    timeout_s=args.timeout_s)
           for r in range(world)]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    print(f"setup (every step's weights, register, connect) {time.perf_counter() - t0:.1f} s")

    def one(r: int, step: int) -> None:
        try:
            stats = exs[r].run()
        except Exception as e:  # noqa: BLE001 - reported; the next run() recovers
            ranks[r].failed(step, e)
            return
        ranks[r].after(step, stats)
    hung = False
    for step in range(args.steps):
        for rk in ranks:
            rk.before(step)
        threads = [threading.Thread(target=one, args=(r, step), daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + STEP_LIMIT_S
        for r, t in enumerate(threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # never go on beside a rank still inside a step
                ranks[r].report["problem"] = (f"step {step}: run() had not returned after "
                                              f"{STEP_LIMIT_S} s (the demo stopped there)")
                hung = True
        if hung:
            break
    if not hung:
        for ex in exs:
            ex.close()
    return [rk.report for rk in ranks], hung + sum(not rk.good() for rk in ranks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "plans", "demo.yaml"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--transport", default="nixl", choices=["nixl", "local"])
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="seconds a rank waits for a peer before its step fails (default 60)")
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return worker(args)

    from planner.compiler import compile_file
    from planner.tools.inspect import inspect_text

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
        cells = [f"{s['bytes'] / 1e6:6.2f} MB {s['seconds'] * 1e3:7.1f} ms" if "error" not in s
                 else "failed" for s in rep["steps"]]
        print(f"{rep['rank']:>4} {rep['role']:<7} " + " ".join(f"{c:>22}" for c in cells))
    exact = [s["bit_exact"] for rep in rows if rep["role"] == "target" for s in rep["steps"]]
    good = not failed and len(exact) == args.steps * sum(r["role"] == "target" for r in rows) \
        and all(exact)
    slowest = max((s["seconds"] for rep in rows for s in rep["steps"]), default=0.0)
    print(f"\n{len(rows)} ranks, {args.steps} steps over {args.transport}: the slowest run() "
          f"took {slowest * 1e3:.1f} ms ({time.perf_counter() - t0:.1f} s in all, starting "
          f"the ranks, imports and connecting included); target tensors bit-exact after every "
          f"step: {'yes' if good else 'NO'}")
    if not good:
        print("why:\n" + "\n".join(f"  {line}" for line in why(rows) or
                                    [f"{failed} rank(s) failed without a report"]))
    return 0 if good else 1


def processes(args: argparse.Namespace, plan: str, world: int) -> tuple[list[dict], int]:
    """One process per rank, over NIXL; the job secret drawn here, handed to every rank."""
    import secrets

    from harness.launch import free_port, root_env, spawn_ranks

    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--plan", plan,
           "--port", str(free_port()), "--steps", str(args.steps), "--transport",
           args.transport, "--timeout-s", str(args.timeout_s)]
    done = spawn_ranks(lambda r: [*cmd, "--worker", str(r)], world,
                       env=root_env(RDMA_PLAN_SECRET=secrets.token_hex(32)), timeout=300,
                       merge_stderr=False)
    failed = 0
    rows = []
    for f in done:
        line = f.output.strip().splitlines()[-1] if f.output.strip() else ""
        rep = json.loads(line) if line.startswith("{") else None
        failed += f.returncode != 0
        if rep is None:
            how = "killed after 300 s" if f.timed_out else f"exit {f.returncode}"
            print(f"rank {f.rank}: FAILED ({how}; its traceback is above)")
            rows.append({"rank": f.rank, "role": "?", "steps": [],
                         "problem": f"no report ({how})"})
            continue
        rows.append(rep)
    return rows, failed


if __name__ == "__main__":
    sys.exit(main())
