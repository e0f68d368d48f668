"""Plan file size and the CPU and memory of compiling it and of every tool that reads it.

    python bench/plan_files.py                      # every config under plans/published/
    python bench/plan_files.py kimi deepseek        # configs whose file name contains one
    python bench/plan_files.py --tree DIR           # run another checkout's code (a `before`)
    python bench/plan_files.py --save rows.jsonl    # keep each row as a JSON line
    python bench/plan_files.py --compare before.jsonl after.jsonl   # side by side
    python bench/plan_files.py --tiny               # plans/demo.yaml only (seconds; the suite)
    python bench/plan_files.py --steps compile      # only these steps (plan bytes always)

Each step is its own process (`python -m planner ...`, or a one-rank load), run one at a
time, and measured by `os.wait4`: its CPU seconds (user + system, not wall time: the box
may be shared) and its peak resident memory. The steps: `compile`; `load1`, one rank's part
read and checked as the executor does at load (`load_rank`, the bounds proof, the per-rank
checks of verify), for the rank with the largest part (also timed inside that process,
without the interpreter's start: `inner_s`); `inspect`, `inspect --ranks`,
`verify`, `simulate`, `explain` of the first layer's first weight the spec lists.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD1 = """
import sys
from schemas.bounds import violations
from schemas.plan import load_rank, open_plan, read_header
from schemas.rankcheck import rank_violations
path = sys.argv[1]
with open_plan(path) as f:
    header, _ = read_header(f, path)
names = [n for n in header.blobs if n.startswith("rank/")]
big = max(names, key=lambda n: header.blobs[n].length)
import resource
t0 = resource.getrusage(resource.RUSAGE_SELF)
h, rp = load_rank(path, int(big.split("/")[1]))
bad = next(iter(violations(rp, h.world)), None) or next(iter(rank_violations(rp, h)), None)
t1 = resource.getrusage(resource.RUSAGE_SELF)
assert bad is None, bad
with open(sys.argv[2], "w") as out:
    out.write(f"{big} {len(rp.writes)} {header.blobs[big].length} "
              f"{t1.ru_utime + t1.ru_stime - t0.ru_utime - t0.ru_stime:.3f}")
"""


def _run(cmd: list[str], tree: str, log: str) -> dict[str, Any]:
    """Run `cmd` with `tree`'s code; its CPU seconds and peak RSS (MiB), from `wait4`."""
    env = {**os.environ, "PYTHONPATH": tree}
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        t = time.monotonic()
        p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=out)
        _, status, ru = os.wait4(p.pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "rss_mib": round(ru.ru_maxrss / 1024), "wall_s": round(time.monotonic() - t, 1)}


def _tensor(config: str, tree: str) -> str:
    """The first matrix of layer 0 the spec lists (a tensor every layout moves)."""
    import yaml

    with open(config, encoding="utf-8") as f:
        model = yaml.safe_load(f)["model"]["config"]
    out = subprocess.run([sys.executable, "-m", "planner", "spec", "--json",
                          os.path.join(os.path.dirname(config), model)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                         text=True, check=True).stdout
    ts = json.loads(out)["tensors"]
    return next((t["name"] for t in ts if ".layers.0." in t["name"] and len(t["shape"]) == 2),
                ts[0]["name"])


def bench(config: str, tree: str, tmp: str, log: str,
          steps: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One config's row: `compile` (always: the plan the other steps read), then each of
    `steps` (default: all of `STEPS`)."""
    steps = STEPS if steps is None else steps
    plan = os.path.join(tmp, "p.rplan")
    py = sys.executable
    row: dict[str, Any] = {"config": os.path.relpath(config, ROOT), "tree": tree}
    row["compile"] = _run([py, "-m", "planner", "compile", config, "-o", plan], tree, log)
    row["plan_bytes"] = os.path.getsize(plan)
    if "load1" in steps:
        _load1(row, plan, tree, log)
    tensor = _tensor(config, tree) if "explain" in steps else ""
    for name, args in (("inspect", ["inspect", plan]), ("ranks", ["inspect", "--ranks", plan]),
                       ("verify", ["verify", plan]), ("simulate", ["simulate", plan]),
                       ("explain", ["explain", plan, tensor])):
        if name in steps:
            row[name] = _run([py, "-m", "planner", *args], tree, log)
    os.unlink(plan)
    return row


def _load1(row: dict[str, Any], plan: str, tree: str, log: str) -> None:
    """The `load1` step: the largest rank part loaded and checked, in its own process."""
    row["load1"] = _run([sys.executable, "-c", LOAD1, plan, plan + ".load1"], tree, log)
    if row["load1"]["rc"] == 0:  # the load and check alone, without the interpreter's start
        with open(plan + ".load1", encoding="utf-8") as f:
            blob, writes, stored, cpu = f.read().split()
        row["load1"].update(blob=blob, writes=int(writes), stored=int(stored), inner_s=float(cpu))


STEPS = ("compile", "load1", "inspect", "ranks", "verify", "simulate", "explain")


def table(rows: list[dict[str, Any]]) -> str:
    head = "| config | plan MB | " + " | ".join(f"{s} s / MiB" for s in STEPS) + " |"
    # load1's cell: its process (s / MiB), then (the load and check alone, s)
    out = [head, "|" + " --- |" * (2 + len(STEPS))]
    for r in rows:
        cells = ["-" if s not in r else f"{r[s]['cpu_s']:.1f} / {r[s]['rss_mib']}" +
                 ("" if r[s]["rc"] == 0 else f" (rc {r[s]['rc']})") for s in STEPS]
        if "inner_s" in r.get("load1", {}):
            cells[1] += f" ({r['load1']['inner_s']:.2f})"
        out.append(f"| {os.path.basename(r['config'])} | {r['plan_bytes'] / 1e6:,.1f} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def _cell(x: dict[str, Any] | None, s: str) -> str:
    if x is None or s not in x:
        return "-"
    c = f"{x[s]['cpu_s']:.1f} / {x[s]['rss_mib']:,}"
    if "inner_s" in x[s]:
        c += f" (load+check alone {x[s]['inner_s']:.2f} s)"
    return c + ("" if x[s]["rc"] == 0 else f" (exit {x[s]['rc']})")


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """One row per config and step: before -> after (CPU s, peak MiB), plan bytes first."""
    old = {r["config"]: r for r in before}
    out = ["| config | step | before: CPU s / peak MiB | after: CPU s / peak MiB |",
           "| --- | --- | --- | --- |"]
    for r in after:
        b = old.get(r["config"])
        name = os.path.basename(r["config"])
        out.append(f"| {name} | plan bytes | {b['plan_bytes']:,} | {r['plan_bytes']:,} "
                   f"({b['plan_bytes'] / r['plan_bytes']:.1f}x smaller) |" if b else
                   f"| {name} | plan bytes | - | {r['plan_bytes']:,} |")
        for s in STEPS:
            if s in r:
                out.append(f"| {name} | {s} | {_cell(b, s)} | {_cell(r, s)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="configs whose file name contains one of these")
    ap.add_argument("--tree", default=ROOT, help="the checkout whose code runs (default: this)")
    ap.add_argument("--save", help="append each row as a JSON line to this file")
    ap.add_argument("--load", help="print the table of rows saved with --save, run nothing")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="print two --save files side by side, run nothing")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "plan_files.log"))
    ap.add_argument("--steps", type=lambda v: tuple(v.split(",")), default=STEPS,
                    help=f"comma-separated steps to run (default: all, {','.join(STEPS)}); "
                    "compile always runs")
    ap.add_argument("--tiny", action="store_true",
                    help="plans/demo.yaml only, every step (seconds: the test suite runs it)")
    a = ap.parse_args(argv)
    if set(a.steps) - set(STEPS):
        ap.error(f"--steps: {','.join(sorted(set(a.steps) - set(STEPS)))} is not a step; "
                 f"choose from {','.join(STEPS)}")
    if a.compare:
        rows = []
        for name in a.compare:
            with open(name, encoding="utf-8") as f:
                rows.append([json.loads(line) for line in f if line.strip()])
        print(compare(*rows))
        return 0
    if a.load:
        with open(a.load, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    configs = sorted(glob.glob(os.path.join(ROOT, "plans/published/*.yaml")))
    configs = [c for c in configs if not a.only or any(s in os.path.basename(c) for s in a.only)]
    if a.tiny:
        configs = [os.path.join(ROOT, "plans", "demo.yaml")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            row = bench(config, os.path.abspath(a.tree), tmp, a.log, a.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.save:
                with open(a.save, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
