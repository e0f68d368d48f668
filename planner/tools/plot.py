"""Pictures of plans and simulations (PNG, matplotlib's Agg backend).

matplotlib is optional: it is imported only when a picture is asked for, and a missing
install is one clear error (`pip install matplotlib`). A plan whose writes all stay on
their hosts (colocated, NVLink only) says so in its NIC panel instead of drawing it empty.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from schemas.errors import UserError
from schemas.header import PlanHeader

TOO_MANY_LABELS = 48
"""Above this many bars, axis ticks are thinned."""


def _save(plt: Any, fig: Any, title: str, path: str) -> str:
    """A figure's title, written to `path` as PNG and closed; returns `path`."""
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed; install it with "
                        "`pip install matplotlib` (or `pip install rdma-plan[plot]`)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, labels: list[str], series: dict[str, np.ndarray], ylabel: str,
          title: str) -> None:
    """Side-by-side bars, one group per label; ticks thinned when there are many."""
    x = np.arange(len(labels))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    step = max(1, -(-len(labels) // TOO_MANY_LABELS))
    ax.set_xticks(x[::step])
    ax.set_xticklabels(labels[::step], rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    top = max((float(np.max(v)) for v in series.values() if len(v)), default=0.0)
    ax.set_ylim(0, top * 1.25 or 1.0)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper right", ncol=len(series))
    ax.grid(axis="y", alpha=0.3)


def plot_plan(header: PlanHeader, path: str) -> str:
    """Bytes sent and received per rank, and bytes out and in per NIC; writes `path`."""
    plt = _pyplot()
    sent = np.array([s.bytes_out for s in header.rank_stats], dtype=np.float64)
    recv = np.array([s.bytes_in for s in header.rank_stats], dtype=np.float64)
    roles = [r.role[0] for r in header.ranks]  # "s" / "t"
    nics = header.nics
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 8), constrained_layout=True)
    _bars(ax1, [f"{i}{roles[i]}" for i in range(len(sent))],
          {"sent": sent / 1e9, "received": recv / 1e9}, "GB",
          f"bytes per rank ({header.sources} sources 's', {header.targets} targets 't')")
    title = (f"bytes per NIC ({nics[0].gbps if nics else '?'} Gb/s each); the plan's floor "
             f"(busiest NIC or NVLink at full bandwidth) {header.stats.floor_s * 1e3:.3g} ms")
    rows = [{"bytes_out": n.bytes_out, "bytes_in": n.bytes_in} for n in nics]
    if _nic_bytes(rows):
        _bars(ax2, [n.name for n in nics],
              {"out": np.array([n.bytes_out for n in nics]) / 1e9,
               "in": np.array([n.bytes_in for n in nics]) / 1e9}, "GB", title)
    else:
        _no_nic_traffic(ax2, header.stats.nvlink_bytes, title)
    return _save(plt, fig, f"{header.model.model_type}: {header.stats.bytes / 1e9:.2f} GB, "
                 f"{header.stats.writes:,} writes", path)


def traffic_path(path: str) -> str:
    """Where `inspect --plot FILE.png` draws the traffic matrix: FILE-traffic.png."""
    root, ext = os.path.splitext(path)
    return f"{root}-traffic{ext or '.png'}"


def plot_traffic(header: PlanHeader, rows: list[tuple[np.ndarray, np.ndarray]],
                 path: str) -> str:
    """Who writes how many bytes to whom: one row per writing rank, one column per receiving
    rank (groups of consecutive ranks above `planner.tools.inspect.MATRIX_CELLS`), NVLink writes
    (same host) and NIC writes (across hosts) side by side, colour on one log scale shared by
    both; writes `path`."""
    from matplotlib.colors import LogNorm

    from planner.tools.inspect import matrix_group

    plt = _pyplot()
    g = matrix_group(header.world)
    n = len(rows[0][0]) if rows else 0
    mats = []
    for part in (0, 1):
        m = np.zeros((n, n))
        for r, pair in enumerate(rows):
            m[r // g] += pair[part]
        mats.append(m)
    top = max((float(m.max()) for m in mats), default=0.0)
    low = min((float(m[m > 0].min()) for m in mats if (m > 0).any()), default=1.0)
    norm = LogNorm(vmin=low, vmax=max(top, low * 10))
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), constrained_layout=True)
    unit = "rank" if g == 1 else f"group of {g} ranks"
    src_edge = header.sources / g - 0.5
    image = None
    for ax, m, name in zip(axes, mats, ("over NVLink (same host)", "over NICs (across hosts)")):
        total = m.sum()
        shown = np.ma.masked_equal(m, 0)
        image = ax.imshow(shown, norm=norm, cmap="viridis", interpolation="nearest",
                          aspect="auto")
        ax.set_facecolor("#f2f2f2")
        for edge in (ax.axhline, ax.axvline):
            edge(src_edge, color="red", lw=0.8, ls="--")
        ax.set_title(f"{name}: {total / 1e9:.3f} GB", fontsize=10)
        ax.set_xlabel(f"receiving {unit} (sources left of the red line, targets right)")
        ax.set_ylabel(f"writing {unit}")
        if not total:
            ax.text(0.5, 0.5, "no writes", ha="center", va="center", transform=ax.transAxes,
                    fontsize=12)
        if n <= 16:
            ax.set_xticks(range(n))
            ax.set_yticks(range(n))
        if n <= 8:  # room to write each cell's bytes in it
            for i, j in zip(*np.nonzero(m)):
                ax.text(j, i, _short_bytes(m[i, j]), ha="center", va="center", fontsize=8,
                        color="white" if m[i, j] < (low * top) ** 0.5 else "black")
    if image is not None:
        fig.colorbar(image, ax=axes, label="bytes written in one refit (log scale)",
                     shrink=0.9)
    return _save(plt, fig, f"{header.model.model_type}: who writes to whom, {header.sources} "
                 f"source and {header.targets} target ranks; grey: no bytes", path)


def _short_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def plot_simulation(res: dict[str, Any], path: str, title: str = "") -> str:
    """Per-NIC load (bytes and busy time) and the timeline of batches; writes `path`."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 9), constrained_layout=True,
                                   gridspec_kw={"height_ratios": [1, 1.4]})
    nics = res["nics"]
    est = max(res["estimated_s"], 1e-12)
    gbps = res["nic_gbps"] * 1e9 / 8
    if not _nic_bytes(nics):
        _no_nic_traffic(ax1, res.get("nvlink_bytes", 0), "per-NIC load")
    else:
        _nic_load(ax1, nics, gbps, est)
    _timeline(plt, ax2, res)
    return _save(plt, fig, title or f"simulated {res['estimated_s'] * 1e3:.1f} ms, floor "
                 f"{res['floor_s'] * 1e3:.1f} ms, ratio {res['ratio']:.3f}; bottleneck "
                 f"{res['bottleneck']}", path)


def _nic_bytes(nics: list[dict[str, Any]]) -> int:
    return sum(int(n["bytes_out"]) + int(n["bytes_in"]) for n in nics)


def _no_nic_traffic(ax: Any, nvlink_bytes: float, title: str) -> None:
    """The NIC panel of a plan whose writes all stay on their hosts: say so, draw nothing."""
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, f"no NIC traffic: every write stays on its host (NVLink, "
            f"{float(nvlink_bytes) / 1e9:.3f} GB)", ha="center", va="center",
            transform=ax.transAxes, fontsize=11)


def _nic_load(ax1: Any, nics: list[dict[str, Any]], gbps: float, est: float) -> None:
    _bars(ax1, [n["name"] for n in nics],
          {"out: bytes / (bw x estimated)": np.array([n["bytes_out"] for n in nics]) / gbps / est,
           "in: bytes / (bw x estimated)": np.array([n["bytes_in"] for n in nics]) / gbps / est,
           "out: busy / estimated": np.array([n["busy_out_s"] for n in nics]) / est,
           "in: busy / estimated": np.array([n["busy_in_s"] for n in nics]) / est},
          "fraction of the transfer", "per-NIC load (1.0 = busy or at full bandwidth "
          "the whole time)")
    ax1.set_ylim(0, 1.25)


def _timeline(plt: Any, ax2: Any, res: dict[str, Any]) -> None:
    """One row per source rank (integer ticks), one lane per in-flight slot."""
    from matplotlib.collections import LineCollection
    from matplotlib.ticker import MaxNLocator

    tl = res["timeline"]
    scale = 1e3
    cmap = plt.get_cmap("tab20")
    lanes = max(int(res.get("inflight", 1)), 1)
    ranks = int(tl["rank"].max()) + 1 if len(tl["rank"]) else 1
    lw = max(0.3, min(2.5, 300 / (ranks * lanes)))
    for chan, style, name in ((0, "-", "NIC"), (1, ":", "NVLink (dotted)")):
        m = tl["chan"] == chan
        if not m.any():
            continue
        y = tl["rank"][m] + (tl["lane"][m] + 0.5) / lanes * 0.8 - 0.4
        segs = np.stack([np.stack([tl["start"][m] * scale, y], 1),
                         np.stack([tl["end"][m] * scale, y], 1)], 1)
        ax2.add_collection(LineCollection(segs, colors=cmap(tl["dst"][m] % 20), linewidths=lw,
                                          linestyles=style, label=name))
    ax2.axvline(res["floor_s"] * scale, color="green", ls="--", lw=1,
                label=f"floor {res['floor_s'] * scale:.1f} ms")
    ax2.axvline(res["estimated_s"] * scale, color="red", ls="--", lw=1,
                label=f"estimated {res['estimated_s'] * scale:.1f} ms")
    ax2.set_xlim(0, res["estimated_s"] * scale * 1.03 or 1)
    ax2.set_ylim(ranks - 0.5, -0.5)
    ax2.set_xlabel("time (ms)")
    ax2.set_ylabel("source rank")
    ax2.set_title(f"{res['batches']:,} batches: one row per source rank, one lane per slot of "
                  "its in-flight window; colour = target rank (same colour at the same time: "
                  "incast)\ngaps: packs, waits, stage barriers", fontsize=9)
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.legend(fontsize=8, loc="lower right")
    ax2.grid(axis="x", alpha=0.3)
