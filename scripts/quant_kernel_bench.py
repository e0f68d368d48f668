"""The FP8 quantizer kernel alone, on the QUANT ops of a compiled plan, beside a copy of the
same bytes (a tool: the figures of BENCHMARKS.md's quantizer row, run on a GPU).

    python3 scripts/quant_kernel_bench.py [--model qwen3-8b:fp8] [--before FILE]
        [--variants 3x2,2x2,4x1,2x3sw] [--reps 20]

Rank 0 of `bench.gpu_refit --gpus 1`'s plan of MODEL (Megatron TP 1 -> vLLM TP 1): its
regions on this GPU (the sources random bfloat16, with a few blocks of NaN, infinity,
values under the 1e-4 amax floor and zeros), its QUANT rows in the launches the executor
makes (a stage's, cut into groups by `executor.pipeline.split`). Each kernel runs every
launch of a step, captured as one CUDA graph, timed by CUDA events over `--reps` replays
(median); its e4m3 values and scales are compared with the first one's byte for byte,
launch by launch (each launch's boxes read right after it: later stages reuse staging).
`--before FILE`: a copy of an earlier `executor/gpu/quant_kernel.py` (its
`SOURCE`, launched as that file did), the first kernel; then this tree's kernel, then the
rows kernel's builds in `--variants` (STAGESxCTAS_PER_SM, `sw`: the e4m3 port for every
value). Every box's bytes are checked against the reference quantizer (torch, on this GPU,
boxes with NaN or infinity left out: there the reference's amax keeps the NaN) and its
first boxes on the CPU. The copy: one `copy_` per launch of that launch's bfloat16 bytes,
eager. Memory traffic: bytes read + written (bfloat16 in; e4m3 and scales out).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gpu_refit.setup import Setup  # noqa: E402
from executor.gpu import quant_kernel as qk  # noqa: E402
from executor.gpu.nvrtc import RuntimeKernel  # noqa: E402
from executor.pipeline import SHARES, split  # noqa: E402
from schemas.plan import PACK, QUANT, STAGING  # noqa: E402
from scripts.cuda_timing import captured, event_seconds, graph_timed  # noqa: E402


def plan_rank(model: str):
    from planner.compiler import compile_config
    from planner.spec import load_spec

    cfg = Setup.for_gpus(1).config(model)
    return compile_config(cfg, load_spec(cfg.model_config_path)).ranks[0]


def launches(p) -> list[np.ndarray]:
    """The QUANT rows of each launch the executor makes (a stage's, or its pack groups')."""
    c, b = p.copies, p.batches
    out = []
    for s in range(p.stages):
        packing = np.flatnonzero((c["stage"] == s) & ((c["kind"] == PACK) | (c["kind"] == QUANT)))
        if not (c["kind"][packing] == QUANT).any():
            continue
        batches = [np.arange(int(b["start"][i]), int(b["stop"][i]))
                   for i in np.flatnonzero(b["stage"] == s)]
        cut = split(p, packing, np.concatenate(batches), len(SHARES)) if batches else None
        groups = cut[0] if cut is not None else [packing]
        out += [g[c["kind"][g] == QUANT] for g in groups if (c["kind"][g] == QUANT).any()]
    return out


def regions_on(p, rows: np.ndarray, dev: torch.device, seed: int) -> list[torch.Tensor]:
    """The rank's regions on `dev`: those QUANT reads random bfloat16, staging zeros, the
    rest one byte (never touched)."""
    c = p.copies
    src = set(np.asarray(c["src_region"])[rows].tolist())
    dst = set(np.asarray(c["dst_region"])[rows].tolist())
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for i, r in enumerate(p.regions):
        if i in src:
            t = torch.empty(r.nbytes // 2, dtype=torch.bfloat16, device=dev)
            for a in range(0, t.numel(), 1 << 28):
                t[a:a + (1 << 28)].normal_(generator=g)
            out.append(t.view(torch.uint8))
        elif i in dst or r.name == STAGING:
            out.append(torch.zeros(r.nbytes, dtype=torch.uint8, device=dev))
        else:
            out.append(torch.zeros(1, dtype=torch.uint8, device=dev))
    return out


def box(p, regions, i: int) -> torch.Tensor:
    c = p.copies
    x = regions[int(c["src_region"][i])].view(torch.bfloat16)
    return x.as_strided((int(c["size0"][i]), int(c["size1"][i])),
                        (int(c["src_stride0"][i]), int(c["src_stride1"][i])),
                        int(c["src_offset"][i]))


def plant(p, regions, rows: np.ndarray) -> set[int]:
    """Special values in a few boxes: NaN, infinity, a block under the amax floor, a zero
    block, one large value; the rows of the boxes with NaN or infinity."""
    special = set()
    for j, i in enumerate(rows[:: max(1, len(rows) // 6)][:6].tolist()):
        x = box(p, regions, i)
        if j % 3 == 0:
            x[0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -1.0])
            x[min(130, x.shape[0] - 1), 7] = -float("inf")
            special.add(i)
        elif j % 3 == 1:
            x[:128, :128] *= 1e-7
            x[-1, -1] = 3e4
        else:
            x[:, :128] = 0.0
    return special


class Before(RuntimeKernel):
    """An earlier kernel file's `SOURCE`, launched as that file's `QuantKernel.op` did."""

    NAME, BLOCKS_PER_SM, FALLBACK = "rplan_quant", 8, "nothing"

    def op(self, table: np.ndarray):
        blocks = qk._blocks(table)
        dev = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)
        per_block = -(-blocks // self.max_blocks)
        grid, nops = (-(-blocks // per_block), 1, 1), len(table)

        def run() -> None:
            self.fn(grid=grid, block=(256, 1, 1), args=[dev, nops, blocks, per_block])
        run.table = dev
        return run


def before_kernel(path: str, dev: torch.device) -> Before:
    text = open(path).read()
    src = re.search(r'SOURCE = (?:E4M3 \+ )?r"""(.*?)"""', text, re.S).group(1)
    Before.SOURCE = src
    k = Before.load(dev)
    assert k is not None, f"{path}: its SOURCE did not build"
    return k


def rows_variant(spec: str, dev: torch.device):
    m = re.fullmatch(r"(\d+)x(\d+)(sw)?", spec)
    assert m, f"--variants {spec}: STAGESxCTAS[sw]"
    stages, ctas, sw = int(m.group(1)), int(m.group(2)), bool(m.group(3))

    class V(qk.RowsQuantKernel):
        SOURCE, BLOCKS_PER_SM = qk.rows_source(stages, ctas, not sw), ctas
        SHARED = stages * qk.THREADS * 8 * 16
    k = V.load(dev)
    assert k is not None, f"variant {spec} did not build"
    return k


def attrs(fn, threads: int, shared: int) -> str:
    """Registers per thread and CUDA blocks resident per SM of a built kernel."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    regs, occ = ctypes.c_int(), ctypes.c_int()
    lib.cuFuncGetAttribute(ctypes.byref(regs), 4, fn.func)  # CU_FUNC_ATTRIBUTE_NUM_REGS
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(occ), fn.func, threads,
                                                    ctypes.c_size_t(shared))
    return f"{regs.value} regs, {occ.value} blocks/SM"


def timed(fn, reps: int) -> float:
    """Median seconds of `fn` captured once as a CUDA graph (after one eager run), over `reps`
    replays (two more before them, timed and dropped)."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_seconds(captured(fn), reps + 2)[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b:fp8")
    ap.add_argument("--before", default="", help="an earlier quant_kernel.py to compare with")
    ap.add_argument("--variants", default="")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu-boxes", type=int, default=4)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    p = plan_rank(a.model)
    groups = launches(p)
    rows = np.concatenate(groups)
    c = p.copies
    elems = int((c["size0"][rows].astype(np.int64) * c["size1"][rows]).sum())
    nblk = int((-(-c["size0"][rows] // 128) * -(-c["size1"][rows] // 128)).sum())
    traffic = 2 * elems + elems + 4 * nblk
    print(f"{a.model} rank 0: {len(rows)} QUANT boxes in {len(groups)} launches, "
          f"{2 * elems / 1e9:.2f} GB bf16 in, {elems / 1e9:.2f} GB e4m3 out; "
          f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    t0 = time.time()
    regions = regions_on(p, rows, dev, seed=3)
    special = plant(p, regions, rows)
    torch.cuda.synchronize()
    print(f"regions ready in {time.time() - t0:.1f} s; boxes with NaN/inf: {len(special)}",
          flush=True)
    outs = sorted(set(np.asarray(c["dst_region"])[rows].tolist()))
    tables = [qk.op_table(c, g, regions) for g in groups]

    builds = []
    if a.before:
        k = before_kernel(a.before, dev)
        builds.append(("before", k, [k.op(t) for t in tables], attrs(k.fn, 256, 0)))
    after = [qk.quant_op(t, dev) for t in tables]
    rk = qk.RowsQuantKernel.load(dev)
    builds.append((f"after ({qk.STAGES}x{qk.ROWS_CTAS_PER_SM})", rk, after,
                   attrs(rk.fn, 256, rk.SHARED)))
    for v in [s for s in a.variants.split(",") if s]:
        k = rows_variant(v, dev)
        builds.append((f"rows {v}", k, [k.op(t) for t in tables], attrs(k.fn, 256, k.SHARED)))

    from harness.weights import quantize_block128

    def outputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's e4m3 values and scales, views into its staging region."""
        m, n = int(c["size0"][i]), int(c["size1"][i])
        dst = regions[int(c["dst_region"][i])]
        row = int(c["dst_stride0"][i])
        q = dst.as_strided((m, n), (row, 1), int(c["dst_offset"][i]))
        sf = dst[: dst.numel() // 4 * 4].view(torch.float32)
        s = sf.as_strided((-(-m // 128), -(-n // 128)), (int(qk.scale_stride(row)), 1),
                          int(c["aux_offset"][i]))
        return q, s

    # Staging is reused across stages (a later launch writes where an earlier one did):
    # every launch's boxes are read right after it runs, one launch at a time.
    kept: list[list[torch.Tensor]] = []
    bad, checked, cpu_done = [], 0, 0
    print("| kernel | build | step ms | per launch us | traffic TB/s | exact |")
    print("|---|---|---:|---:|---:|---|")
    results = {}
    for name, _, ops, at in builds:
        for r in outs:
            regions[r].zero_()
        same = True
        for li, (op, g) in enumerate(zip(ops, groups)):
            op()
            torch.cuda.synchronize()
            got = [t for i in g.tolist() for t in outputs(i)]
            if len(kept) <= li:  # the first kernel: kept, and checked against the reference
                kept.append([t.clone() for t in got])
                for i in g.tolist():
                    if i in special:
                        continue
                    on_cpu = cpu_done < a.cpu_boxes
                    x = box(p, regions, i)
                    q_ref, s_ref = quantize_block128(x.cpu() if on_cpu else x)
                    q, s = outputs(i)
                    if on_cpu:
                        q, s = q.cpu(), s.cpu()
                    cpu_done += on_cpu
                    checked += 1
                    if not (torch.equal(q, q_ref.view(torch.uint8))
                            and torch.equal(s.view(torch.int32), s_ref.view(torch.int32))):
                        bad.append(i)
            else:
                same &= all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                            for x, y in zip(kept[li], got))
        exact = "(first)" if name == builds[0][0] else ("yes" if same else "NO")

        def step(ops=ops) -> None:
            for op in ops:
                op()
        t = timed(step, a.reps)
        results[name] = (t, exact, at)
        print(f"| {name} | {at} | {t * 1e3:.2f} | {t / len(ops) * 1e6:.0f} | "
              f"{traffic / t / 1e12:.2f} | {exact} |", flush=True)
    print(f"reference quantizer (against the first kernel, launch by launch): {checked} boxes "
          f"checked ({cpu_done} on the CPU), {len(bad)} differ"
          f"{': ' + str(bad[:5]) if bad else ''}", flush=True)

    # one copy_ per launch of that launch's bfloat16 bytes
    sizes = [2 * int((c["size0"][g].astype(np.int64) * c["size1"][g]).sum()) for g in groups]
    regions.clear()
    kept.clear()
    torch.cuda.empty_cache()
    src = torch.empty(max(sizes), dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)

    def copies() -> None:
        for n in sizes:
            dst[:n].copy_(src[:n])
    copy_t = graph_timed(copies, a.reps, graph=False)
    copy_rate = 2 * sum(sizes) / copy_t
    print(f"copy: {len(sizes)} copy_ of the launches' bf16 bytes ({sum(sizes) / 1e9:.2f} GB): "
          f"{copy_t * 1e3:.2f} ms, {copy_rate / 1e12:.2f} TB/s of traffic; the quantizer's "
          f"traffic at that rate: {traffic / copy_rate * 1e3:.2f} ms", flush=True)
    print("| kernel | step ms | traffic TB/s | x the copy's rate | exact (launch by launch) |")
    print("|---|---:|---:|---:|---|")
    for name, (t, same, at) in results.items():
        print(f"| {name} ({at}) | {t * 1e3:.2f} | {traffic / t / 1e12:.2f} | "
              f"{traffic / t / copy_rate:.2f} | {same} |")


if __name__ == "__main__":
    main()
