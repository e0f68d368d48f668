"""Compile and simulate every published setup in `plans/published/`, next to its published time.

    python bench/published.py                # print the table
    python bench/published.py --record       # also write it to BENCHMARKS.md
    python bench/published.py qwen3-4b       # only configs whose file name contains this
    python bench/published.py kimi --save rows.jsonl       # keep each row as a JSON line
    python bench/published.py --load rows.jsonl --record   # table from saved rows only
    python bench/published.py --tiny         # the smallest config only (the test suite's)

Each config is compiled by the real CLI (`python -m planner compile`) in its own process,
so the compile time and peak RSS are that process's; then the plan is simulated here
(`planner.tools.simulate`). A config's published time is read from its `# published_s:` line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.tools.simulate import simulate  # noqa: E402

HEADING = "## Published setups (simulated)"
GOAL_RATIO = 1.15
TINY = "qwen3-4b_dp8_to_vllm-tp8"


def published_seconds(path: str) -> float | None:
    with open(path, encoding="utf-8") as f:
        m = re.search(r"^# published_s:\s*([0-9.]+)", f.read(), re.M)
    return float(m.group(1)) if m else None


def compile_one(config: str, out: str) -> dict[str, Any]:
    """Compile with the CLI in a child process: seconds, peak RSS (MiB), plan bytes."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "planner", "compile", config, "-o", out],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()  # type: ignore[union-attr]
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status) != 0:
        return {"error": (stderr.strip() or stdout.strip()).splitlines()[-1:] or ["failed"]}
    return {"compile_s": seconds, "rss_mib": usage.ru_maxrss / 1024,
            "plan_bytes": os.path.getsize(out)}


def run(configs: list[str], save: str | None = None) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            name = os.path.splitext(os.path.basename(config))[0]
            row: dict[str, Any] = {"config": name, "published_s": published_seconds(config)}
            out = os.path.join(tmp, name + ".rplan")
            row.update(compile_one(config, out))
            if "error" not in row:
                res = simulate(out)
                row.update({k: res[k] for k in ("estimated_s", "floor_s", "ratio", "bytes",
                                                "batches", "writes", "stages", "bottleneck",
                                                "sim_seconds", "nic_gbps")})
                row["max_in"] = max((n["bytes_in"] for n in res["nics"]), default=0)
                row["max_out"] = max((n["bytes_out"] for n in res["nics"]), default=0)
                os.remove(out)
            rows.append(row)
            print(_line(row), flush=True)
            if save:
                with open(save, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


COLUMNS = ("config", "published s", "simulated s", "floor s", "ratio", "GB moved",
           "writes", "batches", "stages", "compile s", "plan MB", "peak RSS MiB", "sim s")


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['config']}: compile failed: {row['error'][0]}"
    return (f"{row['config']}: simulated {row['estimated_s']:.3f} s, floor {row['floor_s']:.3f} s"
            f", ratio {row['ratio']:.3f} (published {row['published_s']} s)")


def table(rows: list[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[str]:
        pub = f"{r['published_s']:g}" if r.get("published_s") else "-"
        if "error" in r:
            return [r["config"], pub, "compile failed: " + r["error"][0]] + [""] * 10
        def f(key: str, fmt: str, scale: float = 1.0) -> str:
            if key not in r:
                return "-"
            value = r[key] / scale if scale != 1.0 else r[key]
            return format(int(value) if fmt in (",", "d") else value, fmt)

        return [r["config"], pub, f("estimated_s", ".3f"), f("floor_s", ".3f"),
                f("ratio", ".3f"), f("bytes", ".1f", 1e9), f("writes", ","), f("batches", ","),
                f("stages", "d"), f("compile_s", ".1f"), f("plan_bytes", ".1f", 1e6),
                f("rss_mib", ".0f"), f("sim_seconds", ".1f")]

    out = ["| " + " | ".join(COLUMNS) + " |",
           "| --- | " + " | ".join("---:" for _ in COLUMNS[1:]) + " |"]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(out)


def machine() -> str:
    model = "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", lscpu)
        model = m.group(1).strip() if m else model
    except OSError:
        pass
    return f"{os.cpu_count()} cores (`nproc`), {model}, Python {platform.python_version()}"


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """The arithmetic behind each floor, and where a goal cannot be met."""
    out = []
    for r in rows:
        if "error" in r:
            continue
        gbps = r.get("nic_gbps", 400.0)
        bps = gbps * 1e9 / 8
        if "max_in" in r:
            line = (f"- {r['config']}: busiest NIC takes in {r['max_in'] / 1e9:.2f} GB and "
                    f"sends {r['max_out'] / 1e9:.2f} GB; at {gbps:g} Gb/s ({bps / 1e9:g} GB/s) "
                    f"that is {max(r['max_in'], r['max_out']) / bps:.3f} s ({r['bottleneck']}).")
        else:
            line = (f"- {r['config']}: busiest NIC direction carries "
                    f"{r['floor_s'] * bps / 1e9:.2f} GB at {bps / 1e9:g} GB/s.")
        pub = r.get("published_s")
        if pub and abs(pub / r["floor_s"] - 1) <= 0.05:
            line += " The published time is within 5% of this floor: line rate."
        elif pub and pub < r["floor_s"]:
            line += (" The published time is below this floor: the source moved fewer bytes "
                     "or had more bandwidth per GPU than assumed here.")
        if "kimi" in r["config"] and "max_in" in r and r["estimated_s"] <= 1.0:
            line += (f" Goal <= 1.0 s: met ({r['estimated_s']:.3f} s simulated, "
                     f"{r['bytes'] / 1e12:.2f} TB moved).")
        elif "kimi" in r["config"] and "max_in" in r:
            need = r["max_in"] / 1.0
            line += (f" Goal <= 1.0 s: one target GPU would have to take in {need / 1e9:.0f} "
                     f"GB/s = {need * 8 / 1e9:.0f} Gb/s through its {gbps:g} Gb/s NIC; "
                     "the host's 8 GPUs hold distinct shards (an engine of 16 spans 2 hosts), "
                     "so NVLink cannot help: impossible with this inference layout.")
        out.append(line)
    return out


def section(rows: list[dict[str, Any]], command: str) -> str:
    ok = [r for r in rows if "error" not in r]
    worst = max((r["ratio"] for r in ok), default=float("nan"))
    return "\n".join([
        HEADING, "",
        f"`{command}` on {machine()}, {time.strftime('%Y-%m-%d', time.gmtime())}.", "",
        "Published: the refit or transfer time its source reports (see the comment at the top"
        " of each `plans/published/*.yaml`). Simulated: `rdma-plan simulate` (flow-level, "
        "batches share NIC/NVLink bandwidth max-min fairly, the executor's stage protocol "
        "with its overlaps: packs early, 8 batches in flight across stage boundaries, "
        "signals and the completion barrier; `planner/tools/simulate.py` lists the model). Floor: "
        "the busiest NIC direction (or NVLink) at full bandwidth. Cluster: 8 GPUs and 8 x "
        "400 Gb/s NICs per host, disaggregated. Every config sets 1 GiB of staging.",
        "", table(rows), "",
        f"Goal: simulated within {GOAL_RATIO}x of the floor for every config; worst ratio "
        f"here: {worst:.3f}.", "", "Floors:", "", *notes(rows), "",
    ])


def record(text: str, path: str) -> None:
    """Replace (or append) the section under `HEADING` in `path`."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    start = old.find(HEADING)
    if start < 0:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    else:
        nxt = old.find("\n## ", start + len(HEADING))
        new = old[:start] + text + (old[nxt + 1:] if nxt >= 0 else "")
    with open(path, "w", encoding="utf-8") as f:
        f.write(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("only", nargs="*", help="substrings of config file names to run")
    p.add_argument("--record", action="store_true", help="write the table to BENCHMARKS.md")
    p.add_argument("--save", metavar="FILE", help="append each row to FILE as a JSON line")
    p.add_argument("--load", metavar="FILE", nargs="+", help="rows saved by --save (no "
                   "compiling; a config's last row wins)")
    p.add_argument("--tiny", action="store_true", help=f"only {TINY} (seconds), no --record")
    args = p.parse_args(argv)
    if args.tiny:
        args.only, args.record = [TINY], False
    if args.load:
        by_name: dict[str, dict[str, Any]] = {}
        for path in args.load:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    by_name[row["config"]] = row
        rows = [by_name[k] for k in sorted(by_name)]
    else:
        configs = sorted(glob.glob(os.path.join(ROOT, "plans", "published", "*.yaml")))
        if args.only:
            configs = [c for c in configs if any(s in os.path.basename(c) for s in args.only)]
        rows = run(configs, args.save)
    print()
    print(table(rows))
    if args.record:
        command = "python bench/published.py --save rows.jsonl" + "".join(
            f" {s}" for s in args.only) + "; python bench/published.py --load rows.jsonl --record"
        record(section(rows, command), os.path.join(ROOT, "BENCHMARKS.md"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
