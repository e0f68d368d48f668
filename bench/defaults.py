"""Every example config at default options: simulated time against the floor.

    python3 bench/defaults.py [SUBSTRING ...] [--save rows.jsonl] [--record]
    python3 bench/defaults.py --tiny     # plans/demo.yaml only (the test suite's)

Each `plans/*.yaml` and `plans/published/*.yaml` is compiled with its `options` section
removed (the published configs set 1 GiB of staging by hand), by the real CLI in its own
process, then simulated in its own process (`rdma-plan simulate --json`). Prints config,
writes, stages, estimated and floor ms, ratio, what `simulate` says the gap is made of, and
the most staging one source rank and one target rank allocate (`rdma-plan inspect --json`).
`--record` appends the table to BENCHMARKS.md with the command and machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 1.15


def configs(only: list[str]) -> list[str]:
    paths = sorted(glob.glob(os.path.join(ROOT, "plans", "*.yaml"))) + \
        sorted(glob.glob(os.path.join(ROOT, "plans", "published", "*.yaml")))
    return [p for p in paths if not only or any(s in os.path.basename(p) for s in only)]


def at_defaults(path: str, folder: str) -> str:
    with open(path) as f:
        data = yaml.safe_load(f)
    data.pop("options", None)
    data["model"]["config"] = os.path.normpath(
        os.path.join(os.path.dirname(path), data["model"]["config"]))
    out = os.path.join(folder, os.path.basename(path))
    with open(out, "w") as f:
        yaml.safe_dump(data, f)
    return out


def row(path: str, folder: str) -> dict:
    cfg, plan = at_defaults(path, folder), os.path.join(folder, "plan.rplan")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "planner", "compile", cfg, "-o", plan], check=True,
                   cwd=ROOT, capture_output=True)
    compile_s = time.perf_counter() - t
    out = subprocess.run([sys.executable, "-m", "planner", "simulate", plan, "--json"],
                         check=True, cwd=ROOT, capture_output=True, text=True).stdout
    res = json.loads(out)
    gap = res.get("gap", {})
    ranks = json.loads(subprocess.run([sys.executable, "-m", "planner", "inspect", plan,
                                       "--json"], check=True, cwd=ROOT, capture_output=True,
                                      text=True).stdout)["ranks"]
    staging = {role: max((r["staging"] for r in ranks if r["role"] == role), default=0)
               for role in ("source", "target")}
    return {"config": os.path.relpath(path, os.path.join(ROOT, "plans")),
            "writes": res["writes"], "stages": res["stages"],
            "estimated_ms": res["estimated_s"] * 1e3, "floor_ms": res["floor_s"] * 1e3,
            "ratio": res["ratio"], "largest": gap.get("largest"),
            "compile_s": compile_s, "source_staging_mb": staging["source"] / 1e6,
            "target_staging_mb": staging["target"] / 1e6}


def table(rows: list[dict]) -> str:
    lines = ["| config | writes | stages | simulated ms | floor ms | ratio | largest gap cause "
             "| staging MB, max per source / target rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['writes']:,} | {r['stages']} | "
                     f"{r['estimated_ms']:.1f} | {r['floor_ms']:.1f} | {r['ratio']:.3f} | "
                     f"{r['largest']} | {r.get('source_staging_mb', 0):.1f} / "
                     f"{r.get('target_staging_mb', 0):.1f} |")
    worst = max((r["ratio"] for r in rows), default=0.0)
    lines.append(f"\nWorst ratio {worst:.3f} (goal: every config within {GOAL}x of its floor).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("only", nargs="*")
    p.add_argument("--save", metavar="FILE")
    p.add_argument("--load", metavar="FILE")
    p.add_argument("--record", action="store_true")
    p.add_argument("--tiny", action="store_true", help="plans/demo.yaml only, no --record")
    args = p.parse_args()
    if args.tiny:
        args.only, args.record = ["demo.yaml"], False
    rows = []
    if args.load:
        with open(args.load) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        with tempfile.TemporaryDirectory() as folder:
            for path in configs(args.only):
                r = row(path, folder)
                print(json.dumps(r), flush=True)
                rows.append(r)
                if args.save:
                    with open(args.save, "a") as f:
                        f.write(json.dumps(r) + "\n")
    text = table(rows)
    print(text)
    if args.record:
        cpu = platform.processor() or platform.machine()
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
            f.write("\n## Example configs at default options: simulated time against the "
                    f"floor\n\n`python3 bench/defaults.py` on {os.cpu_count()} cores ({cpu}), "
                    f"Python {platform.python_version()}, {when}.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
