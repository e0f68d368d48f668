"""GPU benchmark: refit time of rdma-plan vs NCCL broadcast vs the NVLink floor (issue 7).

    PYTHONUNBUFFERED=1 python3 bench/gpu_refit.py [--models qwen3-8b,qwen3-30b-a3b]
        [--transports cuda_ipc[,nixl]] [--steps 20] [--warmup 3] [--out DIR]
    python3 bench/gpu_refit.py --cpu-dry-run          # the whole logic on CPU (gloo, nixl)
    python3 bench/gpu_refit.py --render results.json --write-md BENCHMARKS.md

One run on one host with 4 GPUs: 4 processes, one per GPU. Ranks 0-1 are the trainers
(Megatron layout, random bf16 weights generated on the GPU piece by piece from a
deterministic hash of (logical tensor, element index)), ranks 2-3 the inference engine
(vLLM layout, zeros). Per model:

  (a) rdma-plan: the compiled plan replayed by `executor.run` over `cuda_ipc` (and
      optionally `nixl`, UCX over CUDA IPC): per-step wall time over all 4 ranks;
  (b) the baseline most RL frameworks use: logical tensors in 1 GiB buckets; per bucket
      the trainers all-gather their non-replicated shards (NCCL), trainer 0 assembles the
      full HF tensors, broadcasts the bucket (NCCL, group {trainer 0} + inference ranks)
      and each inference rank copies its shards out of it (fusing q/k/v, gate/up, experts
      as vLLM's weight loaders do: one copy per piece of its layout);
  (c) the floor: the most bytes any inference GPU receives / the GPU0 -> GPU2 peer-copy
      bandwidth measured in the same run (`dst.copy_(src)` of a 4 GiB buffer).

A step's time is max(end over ranks) - min(start over ranks) after a barrier (CLOCK_MONOTONIC
is shared by the processes of one host). After (a) and after (b) every inference tensor is
compared bit-exactly with the reference, generated independently from the target layout's
pieces (padding zero); the sources get new values (another seed) before each method so a
stale result cannot pass. `--cpu-dry-run`: tiny models, gloo instead of NCCL, `nixl`
(UCX, DRAM) instead of `cuda_ipc`; it also checks the generator against
`planner.materialize`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS_DIR = os.path.join(ROOT, "plans", "models")
CLUSTER = dict(placement="colocated", hosts=1, gpus_per_host=4, nics_per_host=4,
               source_gpus_per_host=2)
DENSE = (dict(framework="megatron", tp=2, dtype="bfloat16"), dict(engine="vllm", tp=2))
MOE = (dict(framework="megatron", tp=1, dp=2, ep=2, dtype="bfloat16"),
       dict(engine="vllm", tp=2, ep=True))
CASES = {  # model dir -> (source, target); DENSE is plans/qwen3-8b_megatron-tp2_vllm-tp2.yaml
    "qwen3-8b": DENSE, "qwen3-30b-a3b": MOE, "tiny-qwen3": DENSE, "tiny-qwen3-moe": MOE,
}
WORLD, TRAINERS, TARGETS = 4, (0, 1), (2, 3)
ONE_TO_ONE = (dict(framework="megatron", tp=1, dtype="bfloat16"), dict(engine="vllm", tp=1))


def use_gpus(n: int) -> None:
    """`--gpus 2`: one trainer (GPU 0) and one inference GPU (GPU 1), TP 1 on both sides
    (a "MODEL:fp32" case keeps fp32 weights on the trainer: every chunk is cast, so packed
    into staging, which exercises early packs and writes in flight across stages)."""
    global CLUSTER, CASES, WORLD, TRAINERS, TARGETS
    if n == 4:
        return
    if n != 2:
        raise SystemExit(f"--gpus {n}: 4 (the issue's setup) or 2")
    CLUSTER = dict(placement="colocated", hosts=1, gpus_per_host=2, nics_per_host=2,
                   source_gpus_per_host=1)
    fp32 = ({**ONE_TO_ONE[0], "dtype": "float32"}, ONE_TO_ONE[1])
    CASES = {**{m: ONE_TO_ONE for m in CASES}, **{f"{m}:fp32": fp32 for m in CASES}}
    WORLD, TRAINERS, TARGETS = 2, (0,), (1,)
SECTION = "## GPU refit (4x H200)"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def config(model: str, max_write_mib: int | None = None):
    from schemas.config import config_from_dict

    source, target = CASES[model]
    data = {"model": {"config": f"{model.split(':')[0]}/config.json"}, "source": source,
            "target": target, "cluster": CLUSTER}
    if max_write_mib:
        data["options"] = {"max_write_bytes": max_write_mib << 20}
    return config_from_dict(data, base_dir=MODELS_DIR)


# ---------------------------------------------------------------- deterministic weights

def tensor_key(name: str, seed: int) -> int:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def logical_values(shape, offsets, sizes, key: int, device, dtype):
    """The values of box (`offsets`, `sizes`) of a logical tensor of `shape`: a hash of the
    element's linear index, as exact bf16 numbers in [2^-9, 2^-1) with random signs."""
    import torch

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = torch.zeros((1,) * len(sizes), dtype=torch.int64, device=device)
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        view = [1] * len(sizes)
        view[d] = s
        ar = (torch.arange(o, o + s, dtype=torch.int64, device=device) * strides[d])
        idx = idx + ar.view(view)
    x = (idx * 2654435761 + key) & 0xFFFFFFFF
    del idx
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    x ^= x >> 15
    bits = (x & 0x807F) | ((118 + ((x >> 7) & 7)) << 7)
    del x
    bits = bits - ((bits & 0x8000) << 1)
    return bits.to(torch.int16).view(torch.bfloat16).to(dtype)


def fill_pieces(t, pt, spec, seed: int, chunk_elems: int = 1 << 27) -> None:
    """Write the logical values of every piece of physical tensor `pt` into `t`."""
    from planner.materialize import piece_view

    by = spec.by_name
    for piece in pt.pieces:
        view = piece_view(t, piece)
        shape = by[piece.tensor].shape
        key = tensor_key(piece.tensor, seed)
        rows = piece.sizes[0] if piece.sizes else 1
        per_row = max(1, piece.numel // max(rows, 1))
        step = max(1, chunk_elems // per_row)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            off = (piece.offsets[0] + r0, *piece.offsets[1:])
            size = (r1 - r0, *piece.sizes[1:])
            view.narrow(0, r0, r1 - r0).copy_(
                logical_values(shape, off, size, key, t.device, t.dtype))


def generate(tensors: dict, rank_layout, spec, seed: int) -> None:
    for pt in rank_layout.tensors:
        t = tensors[pt.name]
        t.zero_()
        fill_pieces(t, pt, spec, seed)


def check_targets(tensors: dict, rank_layout, spec, seed: int) -> list[str]:
    """Names of the tensors that differ (bit-exactly) from the reference."""
    import torch

    bad = []
    for pt in rank_layout.tensors:
        t = tensors[pt.name]
        want = torch.zeros_like(t)
        fill_pieces(want, pt, spec, seed)
        if not torch.equal(t.view(torch.int16) if t.dtype == torch.bfloat16 else t,
                           want.view(torch.int16) if t.dtype == torch.bfloat16 else want):
            bad.append(pt.name)
        del want
    return bad


def check_generator(spec, layout, local: int, seed: int) -> list[str]:
    """Dry run: the generator agrees with `planner.materialize` from full logical tensors."""
    import torch

    from planner.materialize import DTYPES, materialize

    full = {t.name: logical_values(t.shape, (0,) * len(t.shape), t.shape,
                                   tensor_key(t.name, seed), "cpu", DTYPES[t.dtype])
            for t in spec.tensors}
    ref = materialize(layout, full, ranks=[local])[local]
    mine = {pt.name: torch.empty(pt.shape, dtype=DTYPES[pt.dtype])
            for pt in layout.ranks[local].tensors}
    generate(mine, layout.ranks[local], spec, seed)
    return [n for n in ref if not torch.equal(ref[n], mine[n])]


# ---------------------------------------------------------------- the NCCL baseline

@dataclass
class Bucket:
    nbytes: int = 0
    names: list[str] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
    gathered: list = field(default_factory=list)   # trainers: my non-replicated tensors
    send_bytes: int = 0
    unpack: list = field(default_factory=list)     # trainer 0: (dst view, src view)
    slices: list = field(default_factory=list)     # targets: (dst view, src view)


def _groups(spec, layouts) -> list[list[str]]:
    """Logical tensors that share a physical tensor on any rank of either side, or a
    source tensor name (the same-named shards the trainers all-gather), together."""
    parent = {t.name: t.name for t in spec.tensors}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    seen = set()
    src = layouts[0]  # a tensor the trainers all-gather: every rank's pieces in one bucket
    by_name: dict[str, list[str]] = {}
    for rl in src.ranks:
        for pt in rl.tensors:
            by_name.setdefault(pt.name, []).extend(p.tensor for p in pt.pieces)
    same_name = [(tuple(dict.fromkeys(v)),) for v in by_name.values()]
    for layout in (*layouts, same_name):
        for rl in (layout.ranks if hasattr(layout, "ranks") else [None]):
            for pt in (rl.tensors if rl is not None else layout):
                names = (tuple(dict.fromkeys(p.tensor for p in pt.pieces))
                         if rl is not None else pt[0])
                if len(names) < 2 or names in seen:
                    continue
                seen.add(names)
                for n in names[1:]:
                    a, b = find(names[0]), find(n)
                    if a != b:
                        parent[b] = a
    order = {t.name: i for i, t in enumerate(spec.tensors)}
    groups: dict[str, list[str]] = {}
    for t in spec.tensors:
        groups.setdefault(find(t.name), []).append(t.name)
    return sorted(groups.values(), key=lambda g: order[g[0]])


class Baseline:
    """Bucketed all-gather + broadcast + slice, every view prepared once."""

    ALIGN = 256

    def __init__(self, spec, src, dst, rank: int, tensors: dict, bucket_bytes: int,
                 device, trainers_group, bcast_group, dist) -> None:
        import torch

        from planner.materialize import DTYPES, logical_box, piece_view

        self.rank, self.dist = rank, dist
        self.trainers_group, self.bcast_group = trainers_group, bcast_group
        by = spec.by_name
        nbytes = {t.name: t.numel * torch.empty((), dtype=DTYPES[t.dtype]).element_size()
                  for t in spec.tensors}
        buckets, bucket_of = [Bucket()], {}
        for group in _groups(spec, (src, dst)):
            size = sum(-(-nbytes[n] // self.ALIGN) * self.ALIGN for n in group)
            if buckets[-1].nbytes and buckets[-1].nbytes + size > bucket_bytes:
                buckets.append(Bucket())
            b = buckets[-1]
            for n in group:
                b.offsets[n] = b.nbytes
                b.names.append(n)
                b.nbytes += -(-nbytes[n] // self.ALIGN) * self.ALIGN
                bucket_of[n] = len(buckets) - 1
        self.buckets = buckets
        biggest = max(b.nbytes for b in buckets)
        self.is_trainer, self.is_target = rank in TRAINERS, rank in TARGETS
        in_bcast = rank == 0 or self.is_target
        self.buf = torch.empty(biggest, dtype=torch.uint8, device=device) if in_bcast else None

        def full_view(b: Bucket, name: str):
            t = by[name]
            o = b.offsets[name]
            return self.buf[o:o + nbytes[name]].view(DTYPES[t.dtype]).view(t.shape)

        if self.is_trainer:
            mine = src.ranks[rank].tensors
            others = [{pt.name: pt for pt in src.ranks[r].tensors} for r in TRAINERS]
            for pt in mine:
                if not pt.pieces:
                    continue
                b = buckets[bucket_of[pt.pieces[0].tensor]]
                same = all(o.get(pt.name) is not None and o[pt.name].pieces == pt.pieces
                           for o in others)
                if same:
                    if rank == 0:
                        for piece in pt.pieces:
                            b.unpack.append((logical_box(full_view(b, piece.tensor), piece),
                                             piece_view(tensors[pt.name], piece)))
                    continue
                for o in others:
                    peer = o.get(pt.name)
                    if peer is None or peer.shape != pt.shape or peer.dtype != pt.dtype:
                        raise ValueError(f"baseline: {pt.name} differs in shape across "
                                         "trainers; cannot all-gather it")
                t = tensors[pt.name]
                b.gathered.append((pt, b.send_bytes, t.reshape(-1).view(torch.uint8)))
                b.send_bytes += t.numel() * t.element_size()
            most = max(b.send_bytes for b in buckets)
            self.send = torch.empty(max(most, 1), dtype=torch.uint8, device=device)
            self.recv = torch.empty(max(most, 1) * len(TRAINERS), dtype=torch.uint8,
                                    device=device)
            if rank == 0:
                for b in buckets:
                    for pt, off, _ in b.gathered:
                        for r in TRAINERS:
                            peer_pt = others[r][pt.name]
                            nb = pt.numel * torch.empty((), dtype=DTYPES[pt.dtype]).element_size()
                            base = r * b.send_bytes + off
                            phys = self.recv[base:base + nb].view(DTYPES[pt.dtype]).view(
                                pt.shape)
                            for piece in peer_pt.pieces:
                                b.unpack.append((logical_box(full_view(b, piece.tensor), piece),
                                                 piece_view(phys, piece)))
        if self.is_target:
            for pt in dst.ranks[rank - len(TRAINERS)].tensors:
                for piece in pt.pieces:
                    b = buckets[bucket_of[piece.tensor]]
                    b.slices.append((piece_view(tensors[pt.name], piece),
                                     logical_box(full_view(b, piece.tensor), piece)))
        self.copies = sum(len(b.unpack) + len(b.slices) for b in buckets)

    def step(self, gather: bool = True, bcast: bool = True, local: bool = True) -> None:
        import torch

        dist = self.dist
        for b in self.buckets:
            if self.is_trainer and gather and b.send_bytes:
                n = b.send_bytes
                torch.cat([u8 for _, _, u8 in b.gathered], out=self.send[:n])
                out = self.recv[:n * len(TRAINERS)]
                if hasattr(dist, "all_gather_into_tensor") and out.is_cuda:
                    dist.all_gather_into_tensor(out, self.send[:n], group=self.trainers_group)
                else:
                    dist.all_gather(list(out.chunk(len(TRAINERS))), self.send[:n],
                                    group=self.trainers_group)
            if self.rank == 0 and local:
                for d, s in b.unpack:
                    d.copy_(s)
            if self.buf is not None and bcast:
                dist.broadcast(self.buf[:b.nbytes], src=0, group=self.bcast_group)
            if self.is_target and local:
                for d, s in b.slices:
                    d.copy_(s)


# ------------------------------------------- micro-benchmark: host cost of peer copies

def cudart():
    """`cudaMemcpyAsync` of the libcudart that torch loaded (the executor's one loader), or
    None."""
    from executor.transports.cuda_ipc import load_cudart

    rt = load_cudart()
    return rt.memcpy_async if rt is not None else None


def copy_microbench(n_bytes: int, src, dst) -> dict:
    """Host issue time and GPU time of many 3 MiB peer copies, by method (rank 0)."""
    import torch

    size = 3 << 20
    count = n_bytes // size
    out = {"copies": count, "bytes_each": size}
    d_sl = [dst[i * size:(i + 1) * size] for i in range(count)]
    s_sl = [src[i * size:(i + 1) * size] for i in range(count)]
    fn = cudart()
    streams = [torch.cuda.Stream(0) for _ in range(4)]
    dptr, sptr = dst.data_ptr(), src.data_ptr()

    def torch_loop():
        with torch.cuda.stream(streams[0]):
            for d, s in zip(d_sl, s_sl):
                d.copy_(s)

    def foreach():
        with torch.cuda.stream(streams[0]):
            torch._foreach_copy_(d_sl, s_sl)

    def memcpy(k):
        def go():
            for i in range(count):
                fn(dptr + i * size, sptr + i * size, size, 4, streams[i % k].cuda_stream)
        return go

    def big():
        chunk = 64 << 20
        for i in range(0, n_bytes // chunk):
            fn(dptr + i * chunk, sptr + i * chunk, chunk, 4, streams[0].cuda_stream)

    methods = {"torch copy_ loop": torch_loop, "torch _foreach_copy_": foreach}
    if fn is not None:
        methods.update({"cudaMemcpyAsync 1 stream": memcpy(1),
                        "cudaMemcpyAsync 4 streams": memcpy(4),
                        "cudaMemcpyAsync 64 MiB, 1 stream": big})
    for name, go in methods.items():
        try:
            go()
            best = None
            for _ in range(3):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(2)
                t0 = now()
                go()
                t1 = now()
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(2)
                t2 = now()
                if best is None or t2 - t0 < best[1]:
                    best = (t1 - t0, t2 - t0)
            out[name] = {"issue_s": best[0], "total_s": best[1],
                         "gbps": count * size / best[1] / 1e9}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ---------------------------------------------------------------- the worker processes

def _stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "q1": q[0], "q3": q[2], "n": len(times), "all": times}


class StepError(RuntimeError):
    """A step failed on some rank; every rank raises it after the same barriers."""


class Ctx:
    def __init__(self, args, rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.rank, self.dist, self.torch = args, rank, dist, torch
        self.gpu = not args.cpu_dry_run
        if self.gpu:
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        self.store = dist.TCPStore("127.0.0.1", args.port, WORLD, is_master=rank == 0,
                                   timeout=timedelta(seconds=120))
        limit = timedelta(seconds=max(180.0, 3 * args.exec_timeout))
        dist.init_process_group("nccl" if self.gpu else "gloo", store=self.store, rank=rank,
                                world_size=WORLD, timeout=limit)
        self.cpu_group = (dist.new_group(backend="gloo", timeout=limit) if self.gpu
                          else dist.group.WORLD)
        self.trainers = dist.new_group(list(TRAINERS), timeout=limit)
        self.bcast = dist.new_group([0, *TARGETS], timeout=limit)
        self.runs = 0

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def barrier(self) -> None:
        self.sync()
        self.dist.barrier(group=self.cpu_group)

    def gather(self, obj):
        out = [None] * WORLD
        self.dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def timed(self, step, warmup: int, steps: int) -> dict:
        """Warm-up, then timed steps. A rank whose step raises stops stepping but keeps
        meeting the barriers (its peers time out and do the same), so every rank leaves
        together; then the first error is raised on every rank."""
        error = None

        def one() -> None:
            nonlocal error
            if error is None:
                try:
                    step()
                    self.sync()
                except Exception as e:
                    traceback.print_exc()
                    error = f"rank {self.rank}: {type(e).__name__}: {e}"

        for _ in range(warmup):
            self.barrier()
            one()
        starts, ends = [], []
        for _ in range(steps):
            self.barrier()
            t0 = now()
            one()
            starts.append(t0)
            ends.append(now())
        self.barrier()
        allr = self.gather((starts, ends, error))
        errors = sorted((e[2] for e in allr if e[2]), key=lambda e: "Timeout" in e)
        if errors:
            raise StepError(errors[0])
        times = [max(e[1][i] for e in allr) - min(e[0][i] for e in allr) for i in range(steps)]
        return _stats(times)

    def profile(self, step, label: str, steps: int = 3) -> None:
        """Profile `steps` steps on ranks 0 and 2; print the top ops."""
        if not self.args.profile or not self.gpu:
            return
        from torch.profiler import ProfilerActivity, profile

        on = self.rank in (0, TARGETS[0])
        self.barrier()
        if on:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        failed = False
        for _ in range(steps):
            self.barrier()
            if not failed:
                try:
                    step()
                    self.sync()
                except Exception:
                    traceback.print_exc()
                    failed = True
        if on:
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                              max_name_column_width=60)
            cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10,
                                            max_name_column_width=60)
            print(f"\n=== profile {label} rank {self.rank} ({steps} steps) ===\n{table}\n"
                  f"{cpu}", flush=True)
        self.barrier()


def measure_floor(ctx: Ctx) -> dict:
    """GPU0 -> GPU2 peer copy of a large buffer (rank 0's process does it alone)."""
    torch = ctx.torch
    res = None
    if ctx.rank == 0:
        n = ctx.args.floor_mib << 20
        if ctx.gpu:
            src = torch.empty(n, dtype=torch.uint8, device="cuda:0").fill_(1)
            dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{TARGETS[0]}")
            res = {"pair": f"cuda:0 -> cuda:{TARGETS[0]}", "bytes": n,
                   "can_access_peer": torch.cuda.can_device_access_peer(0, TARGETS[0])}
        else:
            src = torch.ones(n, dtype=torch.uint8)
            dst = torch.empty(n, dtype=torch.uint8)
            res = {"pair": "cpu memcpy (dry run)", "bytes": n}
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(5):
            if ctx.gpu:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(TARGETS[0])
                ev0 = torch.cuda.Event(enable_timing=True)
                ev1 = torch.cuda.Event(enable_timing=True)
                ev0.record()
                dst.copy_(src)
                ev1.record()
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(TARGETS[0])
                times.append(ev0.elapsed_time(ev1) / 1e3)
            else:
                t0 = now()
                dst.copy_(src)
                times.append(now() - t0)
        res["seconds"] = statistics.median(times)
        res["gbps"] = n / res["seconds"] / 1e9
        res["ok"] = bool(torch.equal(dst[: 1 << 20].cpu(), src[: 1 << 20].cpu()))
        if ctx.gpu and ctx.args.copy_microbench:
            res["microbench"] = copy_microbench(n, src, dst)
        del src, dst
        if ctx.gpu:
            torch.cuda.empty_cache()
    return ctx.gather(res)[0]


def run_model(ctx: Ctx, model: str, plan_path: str, out: dict, save,
              transports: list[str], baseline: bool = True) -> dict:
    import executor
    from planner.layouts import build_layout
    from planner.materialize import DTYPES
    from planner.spec import load_spec

    torch, dist, args, rank = ctx.torch, ctx.dist, ctx.args, ctx.rank
    cfg = config(model, args.max_write_mib)
    spec = load_spec(cfg.model_config_path)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    assert src.world == len(TRAINERS) and dst.world == len(TARGETS), (src.world, dst.world)
    is_src = rank in TRAINERS
    rl = src.ranks[rank] if is_src else dst.ranks[rank - len(TRAINERS)]
    if not ctx.gpu and rank in (0, TARGETS[0]):
        layout, local = (src, 0) if rank == 0 else (dst, 0)
        bad = check_generator(spec, layout, local, seed=5)
        print(f"[rank {rank}] generator vs materialize: "
              f"{'OK' if not bad else 'MISMATCH ' + str(bad[:3])}", flush=True)
        if bad:
            raise SystemExit(f"generator disagrees with materialize on {bad[:3]}")
    t0 = now()
    tensors = {pt.name: torch.empty(pt.shape, dtype=DTYPES[pt.dtype], device=ctx.device)
               for pt in rl.tensors}
    mine = sum(t.numel() * t.element_size() for t in tensors.values())
    ctx.barrier()
    seed = 1

    def fresh(seed: int) -> None:
        if is_src:
            generate(tensors, rl, spec, seed)
        else:
            for t in tensors.values():
                t.zero_()
        ctx.barrier()

    def verify(label: str, seed: int) -> bool:
        bad = check_targets(tensors, rl, spec, seed) if not is_src else []
        allbad = ctx.gather(bad)
        ok = not any(allbad)
        if rank == 0:
            print(f"[{model}] {label}: inference tensors bit-exact: "
                  f"{'yes' if ok else 'NO ' + str([b[:3] for b in allbad])}", flush=True)
        return ok

    fresh(seed)
    if rank == 0:
        print(f"[{model}] weights ready in {now() - t0:.1f} s ({mine / 1e9:.2f} GB on rank 0)",
              flush=True)

    def rdma_plan(tr: str) -> None:
        nonlocal seed
        label = f"rdma-plan ({tr})"
        if seed != 1:
            seed += 1
            fresh(seed)
        ctx.runs += 1
        ex, err, t0 = None, None, now()
        try:  # a fresh key prefix per load: never meet a closed executor's descriptors
            store = dist.PrefixStore(f"rplan-{ctx.runs}-{model}-{tr}", ctx.store)
            tr_only, _, inflight = tr.partition("@")  # cuda_ipc:STREAMS@MAX_INFLIGHT
            kind, _, streams = tr_only.partition(":")
            options = None
            if kind.startswith("cuda_ipc"):  # variants, for comparisons in one run
                options = {"streams": int(streams or 4),  # cuda_ipc-raw: no CUDA graphs
                           "graphs": not kind.endswith("-raw")}
                kind = "cuda_ipc"
            ex = executor.load(plan_path, rank=rank, tensors=tensors, transport=kind,
                               rendezvous=store, timeout_s=args.exec_timeout,
                               max_inflight=int(inflight or 8), transport_options=options)
        except Exception as e:
            traceback.print_exc()
            err = f"rank {rank}: {type(e).__name__}: {e}"
        load_s = now() - t0
        errors = [e for e in ctx.gather(err) if e]  # every rank agrees to go on or not
        if errors:
            if ex is not None:
                ex.close()
            out["methods"][label] = {"error": errors[0]}
            save()
            return
        try:
            last = {}

            def step(ex=ex, last=last):
                if args.inject_failure and rank == 1 and ex.step == 0:  # test of StepError
                    raise RuntimeError("injected failure")
                last["stats"] = executor.run(ex)

            res = ctx.timed(step, args.warmup, args.steps)
            res["load_s"] = load_s
            res["bit_exact"] = verify(label, seed)
            if not ctx.gpu and rank == TARGETS[0] and res["bit_exact"]:  # the check can fail
                t = next(iter(tensors.values()))
                t.view(-1)[0] += 1
                caught = check_targets(tensors, rl, spec, seed)
                t.view(-1)[0] -= 1
                assert caught, "check_targets missed a corrupted element"
                print(f"[rank {rank}] a corrupted element is caught: {caught}", flush=True)
            res["run_seconds_last_step_per_rank"] = ctx.gather(last["stats"].seconds)
            res["bytes_written_per_rank"] = ctx.gather(ex.bytes_per_step)
            tstats = ex.transport.stats()
            res["device_copies_per_rank"] = ctx.gather(tstats.get("device_copies"))
            res["raw_copies_per_rank"] = ctx.gather(bool(tstats.get("raw_copies")))
            ctx.profile(step, f"{model} {label}")
        except StepError as e:  # every rank got it: keep going with the other methods
            res = {"error": str(e)}
        finally:
            ex.close()
        out["methods"][label] = res
        save()

    for tr in transports:
        rdma_plan(tr)
    if baseline:
        seed += 1
        fresh(seed)
        run_baseline(ctx, model, spec, src, dst, tensors, out, verify, seed)
        save()
    out["target_bytes"] = ctx.gather(0 if is_src else mine)[TARGETS[0]]
    out["model_bytes"] = spec.total_params * 2
    tensors.clear()
    if ctx.gpu:
        torch.cuda.empty_cache()
    ctx.barrier()
    return out


def run_baseline(ctx: Ctx, model: str, spec, src, dst, tensors: dict, out: dict, verify,
                 seed: int) -> None:
    args, rank = ctx.args, ctx.rank
    t0 = now()
    base = Baseline(spec, src, dst, rank, tensors, args.bucket_mib << 20, ctx.device,
                    ctx.trainers, ctx.bcast, ctx.dist)
    if rank == 0:
        print(f"[{model}] baseline: {len(base.buckets)} buckets of <= {args.bucket_mib} MiB, "
              f"prepared in {now() - t0:.1f} s", flush=True)
    res = ctx.timed(base.step, max(1, args.warmup), args.baseline_steps or args.steps)
    res["bit_exact"] = verify("NCCL baseline", seed)
    res["buckets"] = len(base.buckets)
    res["copies_per_rank"] = ctx.gather(base.copies)
    out["methods"]["NCCL baseline"] = res
    ctx.profile(base.step, f"{model} NCCL baseline", steps=2)
    parts = {}
    for name, kw in (("broadcast only", dict(gather=False, local=False)),
                     ("all-gather only", dict(bcast=False, local=False)),
                     ("local copies only", dict(gather=False, bcast=False))):
        parts[name] = ctx.timed(lambda kw=kw: base.step(**kw), 1, args.part_steps)
    out["baseline_parts"] = parts
    base.__dict__.clear()  # free its buffers and views now


def worker(args) -> int:
    os.environ.update(NO_MULTICAST)
    use_gpus(args.gpus)
    rank = args.worker
    ctx = Ctx(args, rank)
    results = {"floor": None, "models": []}
    try:
        results["floor"] = measure_floor(ctx)
        if rank == 0:
            print(f"floor: {json.dumps(results['floor'])}", flush=True)
        def save() -> None:
            if rank == 0:
                with open(args.results, "w") as f:
                    json.dump(results, f, indent=1)

        for model, plan in zip(args.models, args.plans):
            out = {"model": model, "methods": {}}
            results["models"].append(out)
            run_model(ctx, model, plan, out, save, args.transports[:1])
        # other transports (e.g. nixl) after every model's main results: a hang costs less
        for out, plan in zip(results["models"], args.plans):
            if args.transports[1:]:
                run_model(ctx, out["model"], plan, out, save, args.transports[1:], False)
    finally:
        if rank == 0:
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)
    ctx.dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- parent: compile, launch

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    floor = results.get("floor") or {}
    bw = floor.get("gbps")
    rows, notes = [], []
    for m in results["models"]:
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
    out = [SECTION, "",
           f"Device: {results.get('device')}. Command (on the device, repo root): "
           f"`{results.get('command')}`. {results.get('date', '')}", "",
           f"Peer copy {fl.get('pair')}: {fl.get('gbps', 0):.0f} GB/s "
           f"({fl.get('bytes', 0) / 2**30:.0f} GiB, median of 5, CUDA events). GB/s = the most "
           "bytes one inference GPU receives / seconds. Steps: "
           f"{results.get('steps')} timed after {results.get('warmup')} warm-up; a step is "
           "max(end) - min(start) over the 4 ranks after a barrier.", "",
           "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    if notes:
        out += ["", "Baseline parts (each alone, same buckets):", ""]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny models on CPU: gloo instead of NCCL, nixl instead of cuda_ipc")
    p.add_argument("--models", help="comma-separated model dirs under plans/models")
    p.add_argument("--transports", help="comma-separated executor transports; "
                   "cuda_ipc:N uses N copy streams (default executor.transports.cuda_ipc."
                   "STREAMS), cuda_ipc-raw posts copies one by one (no CUDA graphs); a "
                   "suffix @M keeps M batches in flight (default 8)")
    p.add_argument("--gpus", type=int, default=4, help="4 (2 trainers, 2 inference) or 2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--baseline-steps", type=int, default=0, help="default: --steps")
    p.add_argument("--part-steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=1024)
    p.add_argument("--floor-mib", type=int, default=4096, help="peer-copy buffer size")
    p.add_argument("--max-write-mib", type=int, default=0, help="compile option override")
    p.add_argument("--exec-timeout", type=float, default=120.0)
    p.add_argument("--profile", action="store_true", help="torch profiler tables (GPU)")
    p.add_argument("--copy-microbench", action="store_true",
                   help="time 3 MiB peer copies by method (torch, foreach, cudaMemcpyAsync)")
    p.add_argument("--out", default=None, help="folder for results.json and section.md")
    p.add_argument("--timeout", type=float, default=1500.0, help="whole run, seconds")
    p.add_argument("--render", help="results.json to render (no run)")
    p.add_argument("--write-md", help="replace the section in this markdown file")
    p.add_argument("--note", action="append", default=[],
                   help="with --render: a paragraph to add under the table (repeatable)")
    p.add_argument("--inject-failure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plans", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    dry = args.cpu_dry_run
    use_gpus(args.gpus)
    args.models = (args.models or ("tiny-qwen3,tiny-qwen3-moe" if dry else
                                   "qwen3-8b,qwen3-30b-a3b")).split(",")
    args.transports = (args.transports or ("nixl" if dry else "cuda_ipc")).split(",")
    if args.worker is not None:
        args.plans = args.plans.split(",")
        if dry:
            args.floor_mib = min(args.floor_mib, 64)
            args.bucket_mib = min(args.bucket_mib, 1)  # several buckets, as on GPU
        return worker(args)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        results["notes"] = [*results.get("notes", []), *args.note]
        print(render_text(results))
        if args.write_md:
            write_md(args.write_md, render_md(results))
        return 0

    from planner.compiler import compile_config
    from planner.spec import load_spec
    from planner.validate import validate
    from schemas.plan import write_plan

    out_dir = args.out or tempfile.mkdtemp(prefix="gpu-refit-")
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-refit-plans-")
    plans, compile_info = [], {}
    for model in args.models:
        cfg = config(model, args.max_write_mib)
        spec = load_spec(cfg.model_config_path)
        validate(cfg, spec)
        t0 = time.perf_counter()
        plan = compile_config(cfg, spec)
        path = os.path.join(work, f"{model}.rplan")
        size = write_plan(path, plan)
        st = plan.header.stats
        rank_stats = [dataclasses.asdict(s) for s in plan.header.rank_stats]
        compile_info[model] = {"seconds": time.perf_counter() - t0, "plan_bytes": size,
                               "writes": st.writes, "bytes": st.bytes,
                               "packs": st.packs, "unpacks": st.unpacks,
                               "rank_stats": rank_stats}
        print(f"compiled {model}: {st.writes} writes, {st.bytes / 1e9:.2f} GB, "
              f"{st.packs} packs, {st.unpacks} unpacks, plan {size / 1e6:.2f} MB in "
              f"{compile_info[model]['seconds']:.2f} s; per rank: {rank_stats}", flush=True)
        plans.append(path)
    device = device_name(not dry)
    print(f"device: {device}", flush=True)
    results_path = os.path.join(out_dir, "results.json")
    port = _free_port()
    env = {**os.environ, **NO_MULTICAST, "RDMA_PLAN_SECRET": secrets.token_hex(32),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [a for a in sys.argv[1:]]
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--port", str(port),
           "--plans", ",".join(plans), "--results", results_path,
           "--models", ",".join(args.models), "--transports", ",".join(args.transports)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*cmd, "--worker", str(r)], env=env) for r in range(WORLD)]
    failed = []
    deadline = time.monotonic() + args.timeout
    for r, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            proc.wait()
        if proc.returncode != 0:
            failed.append((r, proc.returncode))
    print(f"workers finished in {time.perf_counter() - t0:.1f} s; failed: {failed or 'none'}",
          flush=True)
    if not os.path.exists(results_path):
        print("no results", flush=True)
        return 1
    with open(results_path) as f:
        results = json.load(f)
    for m in results["models"]:  # the floor's bytes: what the plan writes into one GPU
        stats = compile_info[m["model"]]["rank_stats"]
        m["recv_bytes_max"] = max(stats[r]["bytes_in"] for r in TARGETS)
    shown = " ".join("$OUT" if a == args.out else a for a in argv)
    results.update(device=device, compile=compile_info, steps=args.steps, warmup=args.warmup,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command=f"PYTHONUNBUFFERED=1 python3 bench/gpu_refit.py {shown}".strip())
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    text = render_text(results)
    print("\n" + text, flush=True)
    with open(os.path.join(out_dir, "section.md"), "w") as f:
        f.write(render_md(results))
    if args.write_md:
        write_md(args.write_md, render_md(results))
    exact = [r.get("bit_exact") for m in results["models"] for r in m["methods"].values()]
    ok = not failed and exact and all(exact) and len(results["models"]) == len(args.models)
    print(f"results: {results_path}; all methods bit-exact: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
