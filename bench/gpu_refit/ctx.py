"""A worker's world: process groups, barriers, timed steps that fail together."""

from __future__ import annotations

import json
import mmap
import os
import statistics
import time
import traceback
from datetime import timedelta

from bench.gpu_refit.setup import Setup, now


def _stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "q1": q[0], "q3": q[2], "n": len(times), "all": times}


class StepError(RuntimeError):
    """A step failed on some rank; every rank raises it after the same barriers."""


class Ctx:
    def __init__(self, args, rank: int, setup: Setup) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.rank, self.dist, self.torch = args, rank, dist, torch
        self.setup = setup
        self.gpu = not args.cpu_dry_run
        if self.gpu:
            torch.cuda.set_device(setup.gpu(rank))
            self.device = torch.device("cuda", setup.gpu(rank))
        else:
            self.device = torch.device("cpu")
        self.store = dist.TCPStore("127.0.0.1", args.port, setup.world, is_master=rank == 0,
                                   timeout=timedelta(seconds=120))
        limit = timedelta(seconds=max(180.0, 3 * args.exec_timeout))
        shared = len({setup.gpu(r) for r in range(setup.world)}) < setup.world
        dist.init_process_group("nccl" if self.gpu and not shared else "gloo",
                                store=self.store, rank=rank, world_size=setup.world,
                                timeout=limit)
        self.cpu_group = (dist.new_group(backend="gloo", timeout=limit) if self.gpu
                          else dist.group.WORLD)
        self.trainers = dist.new_group(list(setup.trainers), timeout=limit)
        self.bcast = dist.new_group([0, *setup.targets], timeout=limit)
        self.runs = 0
        self.line, self.crossed = self._start_line(args.port), 0

    def _start_line(self, port: int):
        """One int64 slot per rank in a shared-memory file (every rank is on this host):
        `start` has each rank write its count there and spin until every slot has it, so
        ranks leave within microseconds of each other (a gloo barrier lets them go tens
        to hundreds of microseconds apart, and a timed step runs from the first rank's
        start); None where /dev/shm is not there (the barrier alone then)."""
        import numpy as np

        path = f"/dev/shm/rplan-bench-{port}"
        size = 8 * self.setup.world
        try:
            if self.rank == 0:
                with open(path, "wb") as f:
                    f.write(bytes(size))
            self.dist.barrier(group=self.cpu_group)
            with open(path, "r+b") as f:
                mem = mmap.mmap(f.fileno(), size)
            self.dist.barrier(group=self.cpu_group)
            if self.rank == 0:
                os.unlink(path)
        except OSError:
            return None
        return np.frombuffer(mem, dtype=np.int64)

    def start(self) -> None:
        """Leave together: after `barrier`, every rank spins at the start line."""
        self.barrier()
        if self.line is None:
            return
        self.crossed += 1
        self.line[self.rank] = self.crossed
        deadline = time.monotonic() + max(180.0, 3 * self.args.exec_timeout)
        while int(self.line.min()) < self.crossed:
            if time.monotonic() > deadline:
                raise StepError(f"rank {self.rank}: the other ranks did not reach the start "
                                "line")

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def barrier(self) -> None:
        self.sync()
        self.dist.barrier(group=self.cpu_group)

    def gather(self, obj):
        out = [None] * self.setup.world
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
                except Exception as e:  # noqa: BLE001 - printed, and the rank reports it
                    traceback.print_exc()
                    error = f"rank {self.rank}: {type(e).__name__}: {e}"

        for _ in range(warmup):
            self.start()
            one()
        starts, ends = [], []
        for _ in range(steps):
            self.start()
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
        skews = [max(e[0][i] for e in allr) - min(e[0][i] for e in allr) for i in range(steps)]
        return dict(_stats(times), start_skew_us=statistics.median(skews) * 1e6)

    def profile(self, step, label: str, steps: int = 3) -> None:
        """Profile `steps` steps on every trainer rank and the first target; print the top
        ops."""
        if not self.args.profile or not self.gpu:
            return
        from torch.profiler import ProfilerActivity, profile

        on = self.rank in (*self.setup.trainers, self.setup.targets[0])
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
                except Exception:  # noqa: BLE001 - printed, and the rank reports it
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
            if self.args.out:  # the GPU timeline: (name, start us, duration us) per op
                ops = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start)
                       for e in prof.events() if e.device_type.name == "CUDA"]
                name = "".join(c if c.isalnum() else "_" for c in label)
                with open(os.path.join(self.args.out, f"gpu_{name}_rank{self.rank}.json"),
                          "w") as f:
                    json.dump(ops, f)
        self.barrier()
