"""Benchmark: compile the largest example configs; time, peak RSS, plan size, rank load.

    python3 bench/compile_scale.py [CONFIG ...] [--write]
    python3 bench/compile_scale.py --tiny     # plans/demo.yaml only (the test suite's)

Each config compiles in a fresh subprocess (one process, as `rdma-plan compile` runs),
so peak RSS is that compile's alone. Then one rank's part is loaded from the plan file
(`schemas.plan.load_rank`, what `executor.load` reads) for a few ranks: median time.
Goals: under 60 s and 8 GiB per compile; under 100 ms per rank load.
`--write` appends the table to BENCHMARKS.md with the command and the machine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ["plans/deepseek-v3_megatron-pp16ep16_vllm-tp32x8.yaml",
           "plans/kimi-k2_fsdp2-256_vllm-tp16x8.yaml",
           "plans/qwen3-235b-a22b_megatron-tp4pp8ep16_vllm-tp8x16.yaml"]
TINY = ["plans/demo.yaml"]

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from planner.compiler import compile_file
t = time.perf_counter()
stats = compile_file({config!r}, {out!r})
stats["wall_s"] = time.perf_counter() - t
stats["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(stats))
"""


def bench(config: str, out: str) -> dict:
    code = CHILD.format(root=ROOT, config=os.path.join(ROOT, config), out=out)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise SystemExit(f"{config}: compile failed:\n{res.stderr[-3000:]}")
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    sys.path.insert(0, ROOT)
    from schemas.plan import load_rank

    world = stats.get("world") or 0
    with open(out, "rb") as f:
        from schemas.plan import read_header

        world = read_header(f)[0].world
    times = []
    for r in sorted({0, world // 3, world // 2, world - 1}):
        t = time.perf_counter()
        load_rank(out, r)
        times.append(time.perf_counter() - t)
    stats["rank_load_ms"] = statistics.median(times) * 1e3
    stats["world"] = world
    return stats


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    configs = args or (TINY if "--tiny" in sys.argv else DEFAULT)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in configs:
            s = bench(c, os.path.join(tmp, "plan.rplan"))
            rows.append((c, s))
            print(f"{os.path.basename(c)}: {s['wall_s']:.1f} s, {s['peak_rss_gib']:.2f} GiB, "
                  f"{s['writes']:,} writes, plan {s['plan_bytes'] / 2**20:.1f} MiB, "
                  f"rank load {s['rank_load_ms']:.1f} ms", flush=True)
    head = ("| config | ranks | writes | packs | bytes moved | compile s | peak RSS GiB "
            "| plan MiB | rank load ms |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {os.path.basename(c)} | {s['world']} | {s['writes']:,} | {s['packs']:,} | "
             f"{s['bytes'] / 1e12:.2f} TB | {s['wall_s']:.1f} | {s['peak_rss_gib']:.2f} | "
             f"{s['plan_bytes'] / 2**20:.1f} | {s['rank_load_ms']:.1f} |" for c, s in rows]
    table = "\n".join([head, *lines])
    print(table)
    if "--write" in sys.argv and "--tiny" not in sys.argv:
        cpu = platform.processor() or platform.machine()
        try:
            cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                       if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
            f.write(f"\n## Compile at scale\n\n`python3 bench/compile_scale.py --write` on "
                    f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
                    f"{time.strftime('%Y-%m-%d')}. Goals: < 60 s and < 8 GiB per compile "
                    f"(one process), < 100 ms to load one rank's part.\n\n{table}\n")


if __name__ == "__main__":
    main()
