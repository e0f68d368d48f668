"""The floor (a large peer copy) and the host cost of peer copies by method."""

from __future__ import annotations

import statistics

from bench.gpu_refit.ctx import Ctx
from bench.gpu_refit.setup import now


def cudart():
    """`cudaMemcpyAsync` of the libcudart that torch loaded (the executor's one loader), or
    None."""
    from executor.gpu.cuda_runtime import load_cudart

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
        except Exception as e:  # noqa: BLE001 - the report names the error
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def measure_floor(ctx: Ctx) -> dict:
    """GPU0 -> GPU2 peer copy of a large buffer (rank 0's process does it alone)."""
    torch = ctx.torch
    res = None
    target = ctx.setup.gpu(ctx.setup.targets[0])
    if ctx.rank == 0:
        n = ctx.args.floor_mib << 20
        if ctx.gpu:
            src = torch.empty(n, dtype=torch.uint8, device="cuda:0").fill_(1)
            dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{target}")
            res = {"pair": f"cuda:0 -> cuda:{target}", "bytes": n,
                   "can_access_peer": torch.cuda.can_device_access_peer(0, target)}
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
                torch.cuda.synchronize(target)
                ev0 = torch.cuda.Event(enable_timing=True)
                ev1 = torch.cuda.Event(enable_timing=True)
                ev0.record()
                dst.copy_(src)
                ev1.record()
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(target)
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
