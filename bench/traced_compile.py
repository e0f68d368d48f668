"""Benchmark: compile with target layouts traced from vLLM against the hand-written rules.

    python3 bench/traced_compile.py [CONFIG] [--runs N] [--write]  # default: Qwen3-235B TP8 x 16
    python3 bench/traced_compile.py --tiny                          # plans/demo.yaml, one round

Compiles of one config, each in a fresh process (as `rdma-plan compile` runs), in N rounds
(default 3), the modes interleaved within a round so that a busy machine weighs on all of
them alike: `target.layout: rules`; `traced` with an empty cache, vLLM imported lean in the
forked tracer (`planner/layouts/vllm_lean.py`, `RDMA_PLAN_TRACE_LEAN=1`) and imported
whole (the default, `RDMA_PLAN_TRACE_LEAN=0`); `traced` again (the cache hit). Prints every
run's seconds, the median, the median's ratio to the rules median, the CPU seconds of the
compile's process tree (its tracers included), the tracers forked (`lean`, `whole`, or
`lean, then whole` after a failed lean one), whether the compiling process imported torch
(never: a tracer does) and whether the plans' fingerprints agree (they must: a trace of a
hand-written family equals its rules), and checks that the traced plans are the same bytes
in every mode (the cached compile decodes the trace; an empty-cache one of a family with
rules keeps the plan it compiled with them while tracing, once the trace equals them).
`--write` appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = "plans/qwen3-235b-a22b_megatron-tp4pp8ep16_vllm-tp8x16.yaml"
TINY = "plans/demo.yaml"

CHILD = """
import hashlib, json, sys, time
sys.path.insert(0, {root!r})
from planner.compiler import compile_file
from planner.layouts import trace_ahead
forks = []
fork = trace_ahead._fork
trace_ahead._fork = lambda *a: forks.append(a[-1]) or fork(*a)  # a tracer: lean or not
t = time.perf_counter()
stats = compile_file({config!r}, {out!r})
digest = hashlib.sha256(open({out!r}, "rb").read()).hexdigest()
print(json.dumps({{"s": time.perf_counter() - t, "fingerprint": stats["fingerprint"],
                  "digest": digest,
                  "writes": stats["writes"], "torch": "torch" in sys.modules,
                  "tracers": ", then ".join("lean" if f else "whole" for f in forks)}}))
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


def compile_once(config: str, out: str, cache: str, lean: bool = True) -> dict:
    """One compile in a fresh process: its seconds, fingerprint, whether it imported torch
    and whether it traced (a new file in the trace cache)."""
    env = {**os.environ, "RDMA_PLAN_CACHE": cache, "PYTHONPATH": ROOT,
           "RDMA_PLAN_TRACE_LEAN": "1" if lean else "0"}
    before = _traces(cache)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, config=config,
                                                             out=out)],
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{config}: compile failed:\n{res.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the compile and its tracers
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "cpu": cpu,
            "traced": bool(_traces(cache) - before)}


def _traces(cache: str) -> set[str]:
    folder = os.path.join(cache, "traced")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


MODES = (("rules", "rules", True, False),
         ("traced, empty cache (lean import)", "traced", True, True),
         ("traced, empty cache (whole import)", "traced", False, True),
         ("traced, cached", "traced", True, False))
"""label, target.layout, lean import, empty cache."""


def rounds(config: str, runs: int) -> dict[str, list[dict]]:
    """`runs` rounds of every mode, interleaved; each empty-cache compile in a new cache,
    the cached one in the lean compile's of its round."""
    out: dict[str, list[dict]] = {label: [] for label, *_ in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {layout: variant(config, layout, tmp) for layout in ("rules", "traced")}
        for r in range(runs):
            for i, (label, layout, lean, empty) in enumerate(MODES):
                cache = os.path.join(tmp, f"cache{r}-{i if empty else 1}")
                s = compile_once(configs[layout], os.path.join(tmp, "p.rplan"), cache, lean)
                out[label].append(s)
                print(f"round {r + 1}: {label}: {s['s']:.1f} s ({s['tracers'] or 'no tracer'})",
                      flush=True)
    return out


def table(runs: dict[str, list[dict]]) -> str:
    base = runs["rules"]
    rules = statistics.median(s["s"] for s in base)
    lines = ["| target layout | compile s, each round | median s | x rules (medians) | "
             "x rules, each round | CPU s, median (process tree) | tracers | traced | "
             "compiling process imports torch | plan equal to rules |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, ss in runs.items():
        med = statistics.median(s["s"] for s in ss)
        each = " / ".join(f"{s['s']:.1f}" for s in ss)
        ratios = " / ".join(f"{s['s'] / b['s']:.2f}" for s, b in zip(ss, base))
        tracers = ", ".join(sorted({s["tracers"] or "none" for s in ss}))
        same = all(s["fingerprint"] == base[0]["fingerprint"] for s in ss)
        cpu = statistics.median(s["cpu"] for s in ss)
        lines.append(f"| {label} | {each} | {med:.1f} | {med / rules:.2f} | {ratios} | "
                     f"{cpu:.1f} | {tracers} | {_one(ss, 'traced')} | {_one(ss, 'torch')} | "
                     f"{same} |")
    return "\n".join(lines)


def _one(ss: list[dict], key: str) -> str:
    return " / ".join(sorted({str(s[key]) for s in ss}))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--") and not a.isdigit()]
    config = args[0] if args else (TINY if "--tiny" in sys.argv else DEFAULT)
    n = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else (
        1 if "--tiny" in sys.argv else 3)
    runs = rounds(config, n)
    text = table(runs)
    print(text)
    if not all(s["fingerprint"] == runs["rules"][0]["fingerprint"]
               for ss in runs.values() for s in ss):
        raise SystemExit("the traced plan differs from the hand-written one")
    digests = {s["digest"] for label, ss in runs.items() if label != "rules" for s in ss}
    print(f"traced plans byte-identical in every mode and round: {len(digests) == 1}")
    if len(digests) != 1:  # a cache hit decodes the trace; an empty cache may keep the guess
        raise SystemExit("the traced plans differ between modes")
    if "--write" in sys.argv and "--tiny" not in sys.argv:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                    if ln.startswith("model name")), platform.machine())
        with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
            f.write(f"\n## Traced target layouts: compile time against the hand-written rules\n\n"
                    f"`python3 bench/traced_compile.py "
                    f"--runs {n} --write` ({os.path.basename(config)}) on {os.cpu_count()} "
                    f"cores ({cpu}), Python {platform.python_version()}, "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, shared with other "
                    f"jobs (modes interleaved in each round).\n\n{text}\n")


if __name__ == "__main__":
    main()
