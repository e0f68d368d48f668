"""The `local` transport under load: every step bit-exact, no wait timed out,
no message refused (lost or duplicated), with ranks as threads of one process and as
processes forked after `connect` (`Fabric(shared=True)`).

Two plans (the demo's, 3 stages with staged unpacks; and one of dozens of stages, packs
and writes in flight across stages), `STEPS` steps each, weights changing every step
(targets zeroed before each step, so a missing write shows). Around every signal sent
and every poll, a random pause (none, a yield, 10 us, 100 us or 1 ms); each rank starts
each step after a random delay; in the threads mode the interpreter switches threads
every 50 us; and `SPINNERS` processes spin beside the ranks on the 2-core box. A DONE
sent while the receiver's poll is between copying and clearing its mailbox must not be
lost (the step would time out), and processes forked after `connect` must share one
`local` world."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor.core import Executor
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_file
from planner.frameworks import build_layout
from planner.validate import load
from schemas.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["plans/demo.yaml", "tests/configs/staged-fp32.yaml"]
STEPS = 40
SEEDS = 3  # step k moves weights k % SEEDS: consecutive steps always differ
SPINNERS = 3
TIMEOUT_S = 30.0
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _World:
    """A compiled plan, every rank's tensors, and each seed's weights for every rank."""

    def __init__(self, config: str, folder: Path) -> None:
        self.path = str(folder / "plan.rplan")
        compile_file(str(ROOT / config), self.path)
        cfg, spec = load(str(ROOT / config))
        src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
        self.plan = load_plan(self.path)
        self.sources = src.world
        self.tensors: list[dict[str, torch.Tensor]] = []
        self.wants: list[list[dict[str, torch.Tensor]]] = []
        fulls = [random_full_tensors(spec, seed=100 + k) for k in range(SEEDS)]
        for rank in range(self.plan.header.world):
            layout, local = (src, rank) if rank < src.world else (dst, rank - src.world)
            self.tensors.append({t.name: torch.zeros(t.shape, dtype=_DTYPES[t.dtype])
                                 for t in layout.ranks[local].tensors})
            self.wants.append([materialize(layout, full, ranks=[local])[local]
                               for full in fulls])

    def before(self, rank: int, step: int) -> None:
        """Sources: this step's weights; targets: zeros (a write that is missing shows)."""
        for name, t in self.tensors[rank].items():
            if rank < self.sources:
                t.copy_(self.wants[rank][step % SEEDS][name])
            else:
                t.zero_()

    def check(self, rank: int, step: int) -> list[str]:
        want = self.wants[rank][step % SEEDS]
        return [n for n, t in self.tensors[rank].items() if not torch.equal(t, want[n])]


class _Jitter:
    """A transport whose `notify` and `poll` pause at random before and after."""

    def __init__(self, inner: object, seed: int) -> None:
        self.inner, self.rng = inner, random.Random(seed)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def pause(self) -> None:
        r = self.rng.random()
        if r < 0.3:
            return
        if r < 0.55:
            os.sched_yield()
        else:
            time.sleep(1e-5 if r < 0.8 else 1e-4 if r < 0.95 else 1e-3)

    def notify(self, peer: int, msg: bytes) -> None:
        self.pause()
        self.inner.notify(peer, msg)
        self.pause()

    def poll(self) -> list[tuple[str, bytes]]:
        self.pause()
        msgs = self.inner.poll()
        self.pause()
        return msgs


@contextlib.contextmanager
def _spinning(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _executors(world: _World, fabric: Fabric, seed: int) -> list[Executor]:
    exs = [Executor(world.plan.header, rp, world.tensors[rp.rank], transport="local",
                    rendezvous=fabric,
                    timeout_s=TIMEOUT_S) for rp in world.plan.ranks]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    for ex in exs:
        ex.transport = _Jitter(ex.transport, seed * 1000 + ex.rank)
    return exs


def _rank_steps(world: _World, ex: Executor, steps: range, seed: int,
                prepare: bool) -> list[str]:
    """Steps `steps` of one rank; what went wrong (empty if every step was bit-exact)."""
    rng, bad = random.Random(seed * 7919 + ex.rank), []
    for step in steps:
        if prepare:
            world.before(ex.rank, step)
        time.sleep(rng.choice([0.0, 0.0, 1e-4, 1e-3, 5e-3]))
        try:
            ex.run()
        except Exception as e:  # noqa: BLE001 - reported by the test
            bad.append(f"step {step}, rank {ex.rank}: {type(e).__name__}: {e}")
            break
        if ex.rank >= world.sources and (diff := world.check(ex.rank, step)):
            bad.append(f"step {step}, rank {ex.rank}: {len(diff)} tensors differ: {diff[:3]}")
    if ex.inbox.refused:
        bad.append(f"rank {ex.rank}: {ex.inbox.refused} messages refused: "
                   f"{ex.inbox.last_refused}")
    return bad


def _as_threads(world: _World, steps: int, seed: int) -> list[str]:
    exs = _executors(world, Fabric(), seed)
    bad: list[str] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        for step in range(steps):  # one step at a time: each starts from fresh tensors
            for r in range(len(exs)):
                world.before(r, step)
            out: list[list[str]] = [[] for _ in exs]

            def one(r: int, step: int = step, out: list[list[str]] = out) -> None:
                out[r] = _rank_steps(world, exs[r], range(step, step + 1), seed + step,
                                     prepare=False)
            threads = [threading.Thread(target=one, args=(r,), daemon=True)
                       for r in range(len(exs))]
            for t in threads:
                t.start()
            for r, t in enumerate(threads):
                t.join(4 * TIMEOUT_S)
                if t.is_alive():
                    return [*bad, f"step {step}, rank {r}: still running"]
            bad += [b for o in out for b in o]
            if bad:
                break
    finally:
        sys.setswitchinterval(interval)
        for ex in exs:
            ex.close()
    return bad


def _as_processes(world: _World, steps: int, seed: int) -> list[str]:
    exs = _executors(world, Fabric(shared=True), seed)
    children: dict[int, tuple[int, int]] = {}  # rank -> (pid, read end)
    try:
        for ex in exs:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # one rank per process; it reports through the pipe and goes
                code = 1
                try:
                    os.close(r)
                    torch.set_num_threads(1)
                    bad = _rank_steps(world, ex, range(steps), seed, prepare=True)
                    os.write(w, json.dumps(bad).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            children[ex.rank] = (pid, r)
        bad: list[str] = []
        deadline = time.monotonic() + steps * TIMEOUT_S
        for rank, (_, r) in children.items():
            chunks = []
            while time.monotonic() < deadline:
                if select.select([r], [], [], 1.0)[0]:
                    chunk = os.read(r, 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
            else:
                bad.append(f"rank {rank}: no report within {steps * TIMEOUT_S:g} s")
                continue
            text = b"".join(chunks).decode()
            bad += json.loads(text) if text else [f"rank {rank}: exited without a report"]
        return bad
    finally:
        for pid, r in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(r)
        for ex in exs:
            ex.close()


@pytest.mark.extended
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("ranks_as", ["threads", "processes"])
def test_every_step_is_bit_exact_under_random_pauses_and_a_busy_cpu(tmp_path, config,
                                                                   ranks_as):
    world = _World(config, tmp_path)
    seed = int.from_bytes(os.urandom(4), "little")
    with _spinning(SPINNERS):
        t0 = time.perf_counter()
        run = _as_threads if ranks_as == "threads" else _as_processes
        bad = run(world, STEPS, seed)
        seconds = time.perf_counter() - t0
    print(f"{config}, ranks as {ranks_as}: {STEPS} steps in {seconds:.1f} s (seed {seed})")
    assert not bad, f"seed {seed}:\n" + "\n".join(bad[:10])
