"""Results as a text table and as the BENCHMARKS.md section."""

from __future__ import annotations

import os
import platform
import subprocess

SECTION = "## GPU refit: one bench.gpu_refit call"
"""The heading `--write-md` writes its section under (and replaces, once there)."""



def device_name(gpu: bool) -> str:
    if not gpu:
        return f"CPU dry run ({platform.machine()}, {os.cpu_count()} cores)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=30).stdout
        print(topo, flush=True)
        return f"{len(out)}x {out[0]}" if out else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def table(results: dict) -> tuple[list[list[str]], list[str]]:
    rows, notes = [], []
    for m in results["models"]:  # `--process-per-model`: each model's own floor
        bw = (m.get("floor") or results.get("floor") or {}).get("gbps")
        recv = m.get("recv_bytes_max", 0)
        floor_s = recv / (bw * 1e9) if bw else None
        base = m["methods"].get("NCCL baseline", {}).get("median")
        if floor_s:
            rows.append([m["model"], "floor (max bytes into one GPU / peer copy)",
                         f"{floor_s:.4f}", f"{recv / floor_s / 1e9:.1f}", "1.00", "", ""])
        for name, r in m["methods"].items():
            if "error" in r:
                rows.append([m["model"], name, "failed", "", "", "", r["error"][:60]])
                continue
            med = r["median"]
            rows.append([m["model"], name, f"{med:.4f} [{r['min']:.4f}-{r['max']:.4f}]",
                         f"{recv / med / 1e9:.1f}",
                         f"{med / floor_s:.2f}" if floor_s else "",
                         f"{base / med:.1f}x" if base else "",
                         "yes" if r.get("bit_exact") else "NO"])
        bf16 = next((b for b in results["models"] if m["model"].endswith(":fp8")
                     and b["model"] == m["model"][:-len(":fp8")]), None)
        for name, r in m["methods"].items() if bf16 else ():
            b = bf16["methods"].get(name, {})
            if "median" in r and "median" in b:
                notes.append(f"{m['model']}: {name} takes {r['median'] / b['median']:.2f}x "
                             f"the time of {bf16['model']} (bf16 targets)")
        for name, r in m.get("baseline_parts", {}).items():
            notes.append(f"{m['model']}: baseline {name}: {r['median']:.4f} s "
                         f"[{r['min']:.4f}-{r['max']:.4f}]")
    return rows, notes


HEAD = ["model", "method", "seconds median [min-max]", "GB/s", "x floor", "speedup vs (b)",
        "bit-exact"]


def render_text(results: dict) -> str:
    rows, notes = table(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(HEAD)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEAD, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + [""] + notes)


def render_md(results: dict) -> str:
    rows, notes = table(results)
    fl = results.get("floor") or {}
    ranks = max((len(c.get("rank_stats", [])) for c in (results.get("compile") or {}).values()),
                default=0)
    out = [SECTION, "",
           f"Device: {results.get('device')}. Command (on the device, repo root): "
           f"`{results.get('command')}`. {results.get('date', '')}", "",
           f"Peer copy {fl.get('pair')}: {fl.get('gbps', 0):.0f} GB/s "
           f"({fl.get('bytes', 0) / 2**30:.0f} GiB, median of 5, CUDA events). GB/s = the most "
           "bytes one inference GPU receives / seconds. Steps: "
           f"{results.get('steps')} timed after {results.get('warmup')} warm-up; a step is "
           f"max(end) - min(start) over the {ranks} ranks after a barrier.", "",
           "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    if notes:
        out += ["", "Baseline parts (each alone, same buckets) and FP8 / bf16 times:", ""]
        out += [f"- {n}" for n in notes]
    for line in results.get("notes", []):
        out += ["", line]
    return "\n".join(out) + "\n"


def write_md(path: str, section: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    start = text.find(SECTION)
    if start >= 0:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)
