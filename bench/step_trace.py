"""Where a step's time goes between processes (`BENCH_TRACE=DIR` on executor_bench and on
`bench.gpu_refit`).

Each rank records, per step, when it started, got each wait's signals, sent each signal,
handed a DONE to the GPU (`cuda_ipc`'s device signals), posted its batches, first saw them
landed, and ended (`time.perf_counter`: CLOCK_MONOTONIC, one clock for every process of a
host), and writes them to `DIR/rank{r}.json`; `report` prints each event's median offset
from the source's step start, both ranks on one axis; `report_ranks` every rank's first and
last time of each event, from the step's first start on any rank (many ranks, many batches).
Bench tooling only: it wraps one executor's methods on the instance.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from executor.waits import KIND_NAMES


def attach(ex: Any) -> list[list[tuple[str, float]]]:
    """Record `ex`'s steps from now on (wraps `run`, `begin_step`, `end_step`, `_hand_off`,
    its signals' `wait`, `send` and `sync` and its transport's `post` and `done`); the list
    fills as it runs."""
    steps: list[list[tuple[str, float]]] = []
    run, hand_off = ex.run, ex._hand_off
    wait, signal = ex.signals.wait, ex.signals.send
    post, done = ex.transport.post, ex.transport.done
    landed: set[int] = set()

    def mark(name: str) -> None:
        if steps:
            steps[-1].append((name, time.perf_counter()))

    def t_run(step: Any = None) -> Any:
        steps.append([("start", time.perf_counter())])
        landed.clear()
        out = run(step)
        mark("end")
        return out

    def t_wait(waits: list[tuple[int, int, int]], timeout_s: Any) -> None:
        wait(waits, timeout_s)
        if waits:
            mark("got " + "+".join(sorted({KIND_NAMES[k].split()[0] for _, k, _ in waits})))

    def t_signal(peers: list[int], stage: int, kind: int) -> None:
        signal(peers, stage, kind)
        if peers:
            mark("sent " + KIND_NAMES[kind].split()[0])

    def t_hand_off(stage: int, entries: list[Any]) -> frozenset[int]:
        handed = hand_off(stage, entries)
        if handed:
            mark("handed DONE to the GPU")
        return handed

    def t_post(handle: Any) -> None:
        post(handle)
        mark("posted")

    def t_done(handle: Any) -> bool:
        ok = done(handle)
        if ok and id(handle) not in landed:
            landed.add(id(handle))
            mark("landed")
        return ok

    def after(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            mark(label)
            return out
        setattr(obj, name, wrapped)

    def before(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            mark(label)
            return fn(*a, **k)
        setattr(obj, name, wrapped)

    if os.environ.get("BENCH_TRACE_FINE"):  # the host path's parts too (adds ~1 us each)
        poll, add = ex.transport.poll, ex.inbox.add

        def t_poll() -> Any:
            msgs = poll()
            if msgs:
                mark("polled")
            return msgs

        def t_add(msgs: Any, step: Any) -> None:
            add(msgs, step)
            if msgs:
                mark("checked")
        ex.transport.poll, ex.inbox.add = t_poll, t_add
        after(ex.signals, "msg", "sealed")
        after(ex.signals, "begin", "signals begun")
        after(ex.control, "check", "lease checked")
        after(ex.control, "publish_step", "step record handed")
        before(ex.window, "drain", "drain")
    ex.run, ex._hand_off = t_run, t_hand_off
    after(ex, "begin_step", "begun")
    before(ex, "end_step", "ending")
    after(ex.signals, "sync", "synced")
    ex.signals.wait, ex.signals.send = t_wait, t_signal
    ex.transport.post, ex.transport.done = t_post, t_done
    return steps


def mark(steps: list[list[tuple[str, float]]], name: str) -> None:
    """Record `name` now in the current step of `steps` (what `attach` returned)."""
    if steps:
        steps[-1].append((name, time.perf_counter()))


def save(folder: str, rank: int, steps: list[list[tuple[str, float]]]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(steps, f)


def report(folder: str, source: int = 0, target: int = 1) -> str:
    """Median offset (us) of each event from the source's step start, per rank."""
    with open(os.path.join(folder, f"rank{source}.json")) as f:
        src = json.load(f)
    with open(os.path.join(folder, f"rank{target}.json")) as f:
        dst = json.load(f)
    lines = ["| rank | event | median us after the source's step start |", "| --- | --- | ---: |"]
    for name, steps in (("source", src), ("target", dst)):
        offsets: dict[str, list[float]] = {}
        for i, events in enumerate(steps[:len(src)]):
            t0 = src[i][0][1]
            for k, (event, t) in enumerate(events):
                offsets.setdefault(f"{k:02d} {event}", []).append((t - t0) * 1e6)
        for key in sorted(offsets):
            lines.append(f"| {name} | {key[3:]} | {statistics.median(offsets[key]):.1f} |")
    return "\n".join(lines)


def report_ranks(folder: str, ranks: list[int], skip: int = 0) -> str:
    """Per rank, the median offset (us) of the first and the last time of each event in a
    step from that step's first start on any rank; steps `skip` on (after warm-up)."""
    traces = {}
    for r in ranks:
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            traces[r] = json.load(f)[skip:]
    steps = min(len(t) for t in traces.values())
    ends = [max(t[i][-1][1] for t in traces.values()) - min(t[i][0][1] for t in traces.values())
            for i in range(steps)]
    lines = [f"{steps} steps, first start to last event: median "
             f"{statistics.median(ends) * 1e6:.1f} us" if steps else "no steps",
             "| rank | event | count | first us | last us |", "| --- | --- | ---: | ---: | ---: |"]
    for r, trace in traces.items():
        seen: dict[str, tuple[list[float], list[float], int]] = {}
        for i in range(steps):
            t0 = min(t[i][0][1] for t in traces.values())
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            count: dict[str, int] = {}
            for event, t in trace[i]:
                first.setdefault(event, t - t0)
                last[event] = t - t0
                count[event] = count.get(event, 0) + 1
            for event in first:
                a, b, _ = seen.setdefault(event, ([], [], 0))
                a.append(first[event])
                b.append(last[event])
                seen[event] = (a, b, count[event])
        order = sorted(seen, key=lambda e: statistics.median(seen[e][0]))
        for event in order:
            a, b, k = seen[event]
            lines.append(f"| {r} | {event} | {k} | {statistics.median(a) * 1e6:.1f} | "
                         f"{statistics.median(b) * 1e6:.1f} |")
    return "\n".join(lines)
