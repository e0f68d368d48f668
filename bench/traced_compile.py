"""Benchmark: compile with target layouts traced from vLLM against the hand-written rules.

    python3 bench/traced_compile.py [CONFIG] [--write]   # default: Qwen3-235B TP8 x 16
    python3 bench/traced_compile.py --tiny                # plans/demo.yaml (the suite's)

Three compiles of one config, each in a fresh process (as `rdma-plan compile` runs):
`target.layout: rules`, `traced` with an empty cache (vLLM imported, every engine rank
traced, in a process forked when the compile starts: `planner/layouts/trace_ahead.py`), and
`traced` again (the cache hit). Prints seconds, the ratio to the rules compile, whether the
compile traced (wrote a trace to the cache), whether the compiling process imported torch
(never: a tracer does), and whether the plans' fingerprints agree (they must: a trace of a
hand-written family equals its rules). `--write` appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = "plans/qwen3-235b-a22b_megatron-tp4pp8ep16_vllm-tp8x16.yaml"
TINY = "plans/demo.yaml"

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from planner.compiler import compile_file
t = time.perf_counter()
stats = compile_file({config!r}, {out!r})
print(json.dumps({{"s": time.perf_counter() - t, "fingerprint": stats["fingerprint"],
                  "writes": stats["writes"], "torch": "torch" in sys.modules}}))
"""


def variant(config: str, layout: str, folder: str) -> str:
    """`config` with `target.layout: layout`, its model path made absolute."""
    path = os.path.join(ROOT, config)
    with open(path) as f:
        data = yaml.safe_load(f)
    data["model"]["config"] = os.path.normpath(
        os.path.join(os.path.dirname(path), data["model"]["config"]))
    data["target"]["layout"] = layout
    out = os.path.join(folder, f"{layout}.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(data, f)
    return out


def compile_once(config: str, out: str, cache: str) -> dict:
    """One compile in a fresh process: its seconds, fingerprint, whether it imported torch
    and whether it traced (a new file in the trace cache)."""
    env = {**os.environ, "RDMA_PLAN_CACHE": cache, "PYTHONPATH": ROOT}
    before = _traces(cache)
    res = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, config=config,
                                                             out=out)],
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{config}: compile failed:\n{res.stderr[-3000:]}")
    return {**json.loads(res.stdout.strip().splitlines()[-1]),
            "traced": bool(_traces(cache) - before)}


def _traces(cache: str) -> set[str]:
    folder = os.path.join(cache, "traced")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    config = args[0] if args else (TINY if "--tiny" in sys.argv else DEFAULT)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        runs = [("rules", "rules"), ("traced, empty cache", "traced"),
                ("traced, cached", "traced")]
        for label, layout in runs:
            s = compile_once(variant(config, layout, tmp), os.path.join(tmp, "p.rplan"), cache)
            rows.append((label, s))
            print(f"{label}: {s['s']:.1f} s", flush=True)
    base = rows[0][1]
    same = all(s["fingerprint"] == base["fingerprint"] for _, s in rows)
    head = ("| target layout | compile s | x rules | traced | compiling process imports torch "
            "| plan equal to rules |\n|---|---|---|---|---|---|")
    lines = [f"| {label} | {s['s']:.1f} | {s['s'] / base['s']:.2f} | {s['traced']} | "
             f"{s['torch']} | {s['fingerprint'] == base['fingerprint']} |" for label, s in rows]
    table = "\n".join([head, *lines])
    print(table)
    if not same:
        raise SystemExit("the traced plan differs from the hand-written one")
    if "--write" in sys.argv and "--tiny" not in sys.argv:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                    if ln.startswith("model name")), platform.machine())
        with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
            f.write(f"\n## Traced target layouts (issue 20)\n\n`python3 bench/traced_compile.py "
                    f"--write` ({os.path.basename(config)}) on {os.cpu_count()} cores ({cpu}), "
                    f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}, shared "
                    f"with other jobs (times are upper bounds; ratios from one run).\n\n"
                    f"{table}\n")


if __name__ == "__main__":
    main()
