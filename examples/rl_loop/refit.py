"""One refit of the RL loop's engine, paused or shadow (`train.py`), and the slow source of
`--throttle-ms` / `--stall-step`."""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist
from serving import generated_tokens, post


def paced_engine(throttle_s: dict[int, float]) -> type:
    """The trainer engine with a slow source: this rank sleeps `throttle_s[step]` before its
    writes (`--throttle-ms`, `--stall-step`). Honest about what it is: the bytes are late
    because the source is slow; the engine's update is open and, in shadow mode, serving."""
    from integrations.vllm import RdmaPlanTrainerEngine

    class Paced(RdmaPlanTrainerEngine):
        step = 0

        def write(self) -> None:
            time.sleep(throttle_s.get(self.step, 0.0))
            super().write()
    return Paced


def refit(engine: object, args: argparse.Namespace, label: str, rank: int,
          torn_error: type[Exception]) -> tuple[dict[str, float], str]:
    """One refit; the times on rank 0 and why it was torn ("" when it was not).

    Paused: pause, start_send + finish_send, resume; torn (`--stall-step`): the engine stays
    paused and every rank sends again (the live weights hold part of N+1). Shadow:
    start_send while the engine serves, every rank's writes done (barrier), pause,
    finish_send, resume. `tokens` (shadow): vLLM's generation counter over the transfer
    (start to every rank's writes done); the paused refit reads nothing inside its pause
    (train.py counts the requests answered)."""
    from executor.errors import PeerMismatchError, PeerTimeoutError

    lead, t = rank == 0, {}
    torn = ""
    dist.barrier()

    def send(phase: str) -> None:
        nonlocal torn
        try:
            getattr(engine, phase)(label)
        except (torn_error, PeerTimeoutError, PeerMismatchError) as e:
            torn = f"rank {rank}: {type(e).__name__}"
            print(f"{label}: rank {rank} {phase}: {str(e)[:300]}", flush=True)

    if not args.shadow:
        t["start"] = t["pause"] = time.perf_counter()
        if lead:
            post(args.url, "pause?mode=wait")
        dist.barrier()  # no rank writes before the engine is paused
        t["paused"] = time.perf_counter()
        send("start_send")
        if not torn:
            send("finish_send")
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, torn)
        if any(flags):  # the live weights hold part of N+1: send again before resuming
            t["resent"], torn = "; ".join(f for f in flags if f), ""
            if lead:  # what the paused engine holds now (vLLM's sha256 of each tensor)
                t["torn_sums"] = post(args.url, "weight_checker",
                                      {"action": "checksum"})["checksums"]
            engine.step = -1  # the retry is not slowed (`paced_engine`)
            dist.barrier()
            send("start_send")
            if not torn:
                send("finish_send")
        t["finished"] = time.perf_counter()
        t["transfer"] = t["finished"] - t["paused"]
        t["tokens"] = -1.0  # not read inside the pause: train.py counts answered requests
    else:
        tokens0 = generated_tokens(args.url) if lead else 0.0
        t["start"] = time.perf_counter()
        send("start_send")
        dist.barrier()  # every rank's writes are done
        t["transfer"] = time.perf_counter() - t["start"]
        t["tokens"] = generated_tokens(args.url) - tokens0 if lead else 0.0
        t["pause"] = time.perf_counter()
        if lead:
            post(args.url, "pause?mode=wait")
        t["paused"] = time.perf_counter()
        if lead and engine.open:  # closed already where start_send saw the engine end it
            send("finish_send")
        t["finished"] = time.perf_counter()
    if lead:
        post(args.url, "resume")
    t["resumed"] = time.perf_counter()
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, torn)
    return t, "; ".join(f for f in flags if f)
