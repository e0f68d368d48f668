"""`rdma-plan inspect` and `explain`: a plan, readable by a person.

`explain` reads the header, the explain blob and the rank blobs it names. `inspect`
summarises the header once the file passes what `load_plan` and the executor check: every
rank blob the header lists, intact (checksummed, decodable) and within the bounds proof
(`schemas.bounds`); a file it accepts is one the executor would load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from planner.tools.inspect_placement import placement_lines, placement_summary
from schemas.bounds import violations
from schemas.errors import PlanFormatError
from schemas.header import PlanHeader
from schemas.plan import (
    PACK,
    QUANT,
    STAGING,
    UNPACK,
    RankPlan,
    decode_explain,
    open_plan,
    read_blob,
    read_header,
)
from schemas.shadow import chunked_bytes, shadow_bytes


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _balance(values: list[int]) -> float:
    """max / mean over the NICs that carry traffic (1.0 = perfect)."""
    used = [v for v in values if v > 0]
    return max(used) / (sum(used) / len(used)) if used else 1.0


def _at_least_one(bound: float | None) -> float:
    """The compiler's lower bound on egress max/mean; max/mean is never below 1, so a
    smaller bound (the layouts force nothing) reads as 1."""
    return max(1.0, float(bound)) if bound is not None else 1.0


def summary(header: PlanHeader) -> dict[str, Any]:
    st = header.stats
    src_nics = {r.nic for r in header.ranks if r.role == "source"}
    dst_nics = {r.nic for r in header.ranks if r.role == "target"}
    out_bal = _balance([n.bytes_out for n in header.nics if n.name in src_nics])
    in_bal = _balance([n.bytes_in for n in header.nics if n.name in dst_nics])
    return {
        "fingerprint": header.fingerprint, "created_by": header.created_by,
        "model": header.model.model_type, "world": header.world,
        "sources": header.sources, "targets": header.targets,
        "replicas": header.replicas, "stages": header.stages,
        "ops": st.writes + st.packs + st.unpacks, "writes": st.writes,
        "packs": st.packs, "unpacks": st.unpacks, "bytes": st.bytes,
        "remote_bytes": st.remote_bytes, "nvlink_bytes": st.nvlink_bytes,
        "staging_max": st.staging_max, "floor_s": st.floor_s,
        "balance": {"egress_max_over_mean": out_bal, "ingress_max_over_mean": in_bal,
                    "egress_bound_max_over_mean": _at_least_one(
                        st.egress_bound_max_over_mean)},
        "nics": [{"name": n.name, "bytes_out": n.bytes_out, "bytes_in": n.bytes_in}
                 for n in header.nics],
        "ranks": [{"rank": r, "role": row.role, "writes": s.writes, "bytes_out": s.bytes_out,
                   "bytes_in": s.bytes_in, "packs": s.packs, "unpacks": s.unpacks,
                   "staging": s.staging}
                  for r, (row, s) in enumerate(zip(header.ranks, header.rank_stats))],
    }


def checked_header(path: str, why: dict[int, str] | None = None,
                   progress: Callable[[str], None] | None = None,
                   shadow: dict[int, int] | None = None,
                   chunked: dict[int, int | None] | None = None,
                   traffic: list[tuple[np.ndarray, np.ndarray]] | None = None
                   ) -> PlanHeader:
    """The header of the plan at `path`, once every blob it lists is intact (checksummed,
    decodable: what `load_plan` checks) and every rank within bounds (what the executor
    checks), else `PlanFormatError`; read one rank at a time. `why`, when given, gets each
    rank's `staging_why` from the same read; `shadow`, each rank's full-shadow bytes;
    `chunked`, its chunked shadow's bytes (None: not compiled with one); `traffic`, each
    rank's bytes written to every rank (`traffic_row`)."""
    from planner.collector import gc_paused
    from planner.tools.planfile import PlanFile, ticker

    with PlanFile(path) as src, gc_paused():
        header = src.header
        needed = [*(f"rank/{r}" for r in range(header.world)), "explain", "dag"]
        extra = [n for n in header.blobs if n.startswith("tensors/")]
        if sorted(header.blobs) != sorted(needed + extra) or \
                not set(extra) <= {f"tensors/{r}" for r in range(header.world)}:
            raise PlanFormatError(f"{path}: the header's blob index does not list exactly "
                                  f"{header.world} rank blobs, explain, dag and tensors blobs; "
                                  "the file is corrupt")
        tick = ticker(progress, "ranks", header.world)
        for r in range(header.world):
            rp = src.rank(r)
            for msg in violations(rp, header.world):
                raise PlanFormatError(f"{path}: {msg}")
            if why is not None:
                why[r] = staging_why(rp, header)
            if shadow is not None:
                shadow[r] = shadow_bytes(rp)
            if chunked is not None:
                chunked[r] = chunked_bytes(rp)
            if traffic is not None:
                traffic.append(traffic_row(rp, header, r))
            tick(r)
        src.dag()
        src.check_rest(progress)
    return header


MATRIX_CELLS = 256
"""Most rows (and columns) of the traffic matrix; larger worlds are binned into groups of
consecutive ranks."""


def matrix_group(world: int) -> int:
    """Ranks per row of the traffic matrix (1 up to `MATRIX_CELLS` ranks)."""
    return -(-world // MATRIX_CELLS)


def traffic_row(rp: RankPlan, header: PlanHeader, rank: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes `rank` (its plan `rp`) writes into each group of ranks (`matrix_group`) in the
    whole plan: over NVLink (the target on its host) and over NICs (another host)."""
    world = header.world
    g = matrix_group(world)
    w = rp.writes
    host = np.array([r.host for r in header.ranks], dtype=np.int64)
    dst = w["dst_rank"].astype(np.int64)
    same = host[dst] == host[rank] if len(host) == world else np.ones(len(dst), bool)
    size = w["nbytes"].astype(np.float64)
    n = -(-world // g)
    return (np.bincount(dst[same] // g, weights=size[same], minlength=n),
            np.bincount(dst[~same] // g, weights=size[~same], minlength=n))


def staging_why(rp: RankPlan, header: PlanHeader | None = None) -> str:
    """Why rank `rp` has staging: the stage that puts the most bytes there, what fills it
    (packs or QUANTs of this rank's tensors, or peers' writes unpacked here) and the
    tensor with most of those bytes, then (given the plan's `header`) how its budget was
    chosen (`planner.passes.budget`); "" without staging."""
    names = [r.name for r in rp.regions]
    if STAGING not in names:
        return ""
    what = _staging_use(rp, names)
    if header is None or not what or not 0 <= rp.rank < min(len(header.ranks),
                                                             len(header.rank_stats)):
        return what  # (a hand-built header may list no ranks)
    return f"{what}; {_budget_why(rp, header, names.index(STAGING))}"


def _budget_why(rp: RankPlan, header: PlanHeader, st: int) -> str:
    from planner.passes.budget import budget_why
    from schemas.protocol import ITEM

    c = rp.copies
    m = (c["kind"] == UNPACK) & (c["src_region"] == st)
    n = c["size0"][m] * c["size1"][m] * c["size2"][m] * ITEM[c["src_dtype"][m]]
    return budget_why(header.ranks[rp.rank].role, int(n.max(initial=0)), int(n.sum()),
                      header.rank_stats[rp.rank].bytes_in, header.options,
                      header.cluster.nic_gbps)


def _staging_use(rp: RankPlan, names: list[str]) -> str:
    """The stage that puts the most bytes in `rp`'s staging, what fills it and the tensor
    with most of those bytes."""
    st, c, w = names.index(STAGING), rp.copies, rp.writes
    size = (c["size0"] * c["size1"] * c["size2"]).astype(np.float64)
    packs = np.isin(c["kind"], (PACK, QUANT)) & (c["dst_region"] == st)
    unpacks = (c["kind"] == UNPACK) & (c["src_region"] == st)
    rows = [(c["stage"][m], c[other][m], size[m], why) for m, other, why in
            ((packs, "src_region", "packed from"), (unpacks, "dst_region", "unpacked into"))]
    if not any(len(r[0]) for r in rows):
        return "peers' writes" if (w["dst_region"] == st).any() else ""
    per_stage = np.bincount(np.concatenate([r[0] for r in rows]),
                            weights=np.concatenate([r[2] for r in rows]))
    stage = int(np.argmax(per_stage))
    best = max(rows, key=lambda r: float(r[2][r[0] == stage].sum()))
    m = best[0] == stage
    tensor = int(np.argmax(np.bincount(best[1][m], weights=best[2][m])))
    return f"stage {stage}: {best[3]} {names[tensor]}"


def inspect_text(path: str, as_json: bool = False,
                 progress: Callable[[str], None] | None = None,
                 traffic: list[tuple[np.ndarray, np.ndarray]] | None = None) -> str:
    """The summary, per-NIC and per-rank tables (or JSON); `traffic`, when given, gets each
    rank's bytes written to every rank group from the same read (`traffic_row`)."""
    why: dict[int, str] = {}
    shadow: dict[int, int] = {}
    chunked: dict[int, int | None] = {}
    header = checked_header(path, why, progress, shadow, chunked, traffic)
    s = summary(header)
    s["placement"] = placement_summary(path, header)  # None: no target.placement
    for r, row in enumerate(s["ranks"]):
        row["staging_why"] = why.get(r, "")
        row["shadow"] = shadow.get(r, 0)  # zero-pause refit's full shadow (executor/shadow.py)
        row["extra_memory"] = {"paused": 0, "full_shadow": row["shadow"],
                               "chunked_shadow": chunked.get(r)}  # None: not compiled
    if as_json:
        return json.dumps(s, indent=1)
    src, tgt = header.source, header.target
    sides = "source ? -> target ?" if src is None or tgt is None else (
        f"source {src.framework} tp{src.tp} pp{src.pp} dp{src.dp} ep{src.ep} {src.dtype} -> "
        f"target {tgt.engine} tp{tgt.tp} dp{tgt.dp}"
        f"{' expert-parallel' if tgt.ep else ''}, {_count(tgt.replicas, 'replica')}, "
        f"{tgt.dtype}")
    lines = [
        f"plan {path}  fingerprint {s['fingerprint']}  ({s['created_by']})",
        f"model {s['model']} ({params_text(header.model.total_params)} params); {sides}",
        f"ranks {s['sources']} source + {s['targets']} target; stages {s['stages']}; "
        f"ops {s['ops']} ({s['writes']} writes, {s['packs']} packs, {s['unpacks']} unpacks)",
        f"bytes {_gb(s['bytes'])} (over NICs {_gb(s['remote_bytes'])}, NVLink "
        f"{_gb(s['nvlink_bytes'])}); staging max {s['staging_max'] / 2**20:.1f} MiB/rank",
        f"balance (max/mean over busy NICs): egress (source NICs) "
        f"{s['balance']['egress_max_over_mean']:.3f}, ingress (target NICs) "
        f"{s['balance']['ingress_max_over_mean']:.3f}; no assignment of these layouts gets "
        f"egress below {s['balance']['egress_bound_max_over_mean']:.3f}",
        f"floor {s['floor_s'] * 1e3:.3f} ms: a lower bound, not an estimate (the busiest NIC "
        "or NVLink moving its bytes at full bandwidth; no latency, packing or contention; "
        "`rdma-plan simulate` estimates the time)",
        f"extra memory per target rank (largest): paused refit 0; full shadow (executor/"
        f"shadow.py) + {max([0, *shadow.values()]) / 2**20:.1f} MiB (column shadow); "
        + _chunked_line(header, chunked), "",
    ]
    nics = s["nics"]
    if not any(n["bytes_out"] or n["bytes_in"] for n in nics):
        lines.append(f"nics: none carries a byte: every write stays on its host (NVLink, "
                     f"{_gb(s['nvlink_bytes'])})")
    else:
        lines += _table(["nic", "bytes out", "bytes in"],
                        [[n["name"], f"{n['bytes_out']:,}", f"{n['bytes_in']:,}"] for n in nics],
                        "NICs")
    lines.append("")
    head = ["rank", "role", "writes", "bytes out", "bytes in", "packs", "unpacks", "staging",
            "shadow", "chunked", "staging for"]
    rows = [[str(r["rank"]), r["role"], f"{r['writes']:,}", f"{r['bytes_out']:,}",
             f"{r['bytes_in']:,}", f"{r['packs']:,}", f"{r['unpacks']:,}",
             f"{r['staging']:,}", f"{r['shadow']:,}",
             _opt(r["extra_memory"]["chunked_shadow"]), r["staging_why"]] for r in s["ranks"]]
    lines += _table(head, rows, "ranks", left=frozenset({1, 10}))
    return "\n".join(lines + placement_lines(s["placement"]))


SHOWN = 16
"""Rows shown at each end of a long table (the rest: `--json`)."""


def _table(head: list[str], rows: list[list[str]], what: str,
           left: frozenset[int] = frozenset({0})) -> list[str]:
    """`rows` under `head`, each column as wide as its widest cell (numbers right-aligned,
    columns `left` left-aligned, two spaces apart); over 2 * SHOWN rows, the first and last
    SHOWN with one line between them naming the rows left out."""
    cut = len(rows) > 2 * SHOWN
    shown = rows[:SHOWN] + rows[-SHOWN:] if cut else rows
    widths = [max(len(r[i]) for r in [head, *shown]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(head), *map(line, shown[:SHOWN] if cut else shown)]
    if cut:
        out.append(f"... {what} {rows[SHOWN][0]} to {rows[-SHOWN - 1][0]} left out "
                   f"({len(rows) - 2 * SHOWN} rows; --json lists all)")
        out += map(line, shown[SHOWN:])
    return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def params_text(n: int) -> str:
    """A parameter count as people say it: 7.62B, 40.5M, 12.3K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n < 100 * size else f"{n / size:.0f}{unit}"
    return str(n)


def _opt(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _chunked_line(header: PlanHeader, chunked: dict[int, int | None]) -> str:
    sh = None if header.target is None else header.target.shadow
    if sh is None or not sh.budget_bytes:
        return "chunked shadow: not compiled (target.shadow: {budget_bytes: N})"
    used = max([0, *(b for b in chunked.values() if b is not None)])
    return (f"chunked shadow + {used / 2**20:.1f} MiB used of its {sh.budget_bytes / 2**20:.1f}"
            " MiB budget (column chunked)")


def explain_text(path: str, tensor: str, as_json: bool = False,
                 progress: Callable[[str], None] | None = None) -> str:
    """How the logical (HF checkpoint) tensor `tensor` moves: who sends which bytes to whom,
    and, for gathered boxes, which source ranks hold it before the gather. `progress` is
    told each step (the explain blob is hundreds of MB on a large plan)."""
    if progress is not None:
        progress("reading the explain blob")
    with open_plan(path) as f:
        header, start = read_header(f, path)
        names, t = decode_explain(read_blob(f, header, start, "explain", path), path)
        if progress is not None:
            progress("reading the ranks it names")
        if tensor not in names:
            close = close_names(tensor, names)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                "; `rdma-plan spec` lists the names"
            raise PlanFormatError(f"explain: {tensor!r} is not a tensor of this plan's model: "
                                  f"explain takes HF checkpoint names (e.g. {names[0]}){hint}")
        m = np.nonzero(t["tensor"] == names.index(tensor))[0]
        ranks = sorted(set(t["src_rank"][m].tolist()) | set(t["dst_rank"][m].tolist()))
        regions = {r: RankPlan.decode(read_blob(f, header, start, f"rank/{r}", path)).regions
                   for r in ranks}
    for i in m.tolist():
        for rank, reg in ((int(t["src_rank"][i]), int(t["src_region"][i])),
                          (int(t["dst_rank"][i]), int(t["dst_region"][i]))):
            if not 0 <= reg < len(regions[rank]):
                raise PlanFormatError(f"{path}: explain names region {reg} of rank {rank}, "
                                      "which it does not have; the file is corrupt")
    rows = [{"source_rank": int(t["src_rank"][i]),
             "source": regions[int(t["src_rank"][i])][t["src_region"][i]].name,
             "target_rank": int(t["dst_rank"][i]),
             "target": regions[int(t["dst_rank"][i])][t["dst_region"][i]].name,
             "bytes": int(t["nbytes"][i]), "boxes": int(t["boxes"][i])} for i in m.tolist()]
    gathered = sorted({r["source_rank"] for r in rows if r["source"] == STAGING})
    if progress is not None:
        progress("reading the source ranks' tensors")
    holders = _source_holders(path, header, tensor)
    senders = sorted({r["source_rank"] for r in rows})
    out = {"tensor": tensor, "bytes": sum(r["bytes"] for r in rows),
           "target_ranks": len({r["target_rank"] for r in rows}),
           "source_ranks_sending": senders, "source_ranks_holding": holders,
           "gathered_on": gathered, "writes": rows}
    return json.dumps(out, indent=1) if as_json else _explain_lines(out)


def close_names(name: str, names: list[str], n: int = 3) -> list[str]:
    """The names `name` most likely meant: those holding all its dotted parts in order
    (`model.layers.0.q_proj.weight` -> `model.layers.0.self_attn.q_proj.weight`), shortest
    first; else the closest spellings."""
    import difflib

    parts = name.split(".")

    def holds(candidate: str) -> bool:
        it = iter(candidate.split("."))
        return all(p in it for p in parts)

    within = sorted((c for c in names if holds(c)), key=lambda c: (len(c), c))
    return within[:n] or difflib.get_close_matches(name, names, n, cutoff=0.5)


def _explain_lines(e: dict[str, Any]) -> str:
    held = e["source_ranks_holding"]
    n_src = len(held) if held is not None else len(e["source_ranks_sending"])
    lines = [f"{e['tensor']}: {e['bytes']:,} bytes into {e['target_ranks']} target ranks "
             f"from {n_src} source ranks"]
    if e["gathered_on"]:
        lines.append(f"  gathered first: the {n_src} source ranks holding pieces of it write "
                     f"them into the staging of source rank(s) "
                     f"{_rank_list(e['gathered_on'])}, which send(s) the whole boxes")
    for r in e["writes"]:
        src = "staging (gathered)" if r["source"] == STAGING else r["source"]
        lines.append(f"  source rank {r['source_rank']:>4} {src:<50} -> target rank "
                     f"{r['target_rank']:>4} {r['target']:<50} {r['bytes']:>14,} bytes in "
                     f"{r['boxes']} boxes")
    return "\n".join(lines)


def _rank_list(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")


def _source_holders(path: str, header: PlanHeader, tensor: str) -> list[int] | None:
    """The source ranks that hold a piece of `tensor` (their `tensors/<rank>` blobs); None
    when the plan does not list its ranks' tensors."""
    from schemas.tensors import holders

    if any(f"tensors/{r}" not in header.blobs for r in range(header.sources)):
        return None
    return holders(path, tensor.removesuffix("_scale_inv"))
