"""The trainer side's plan rank, identity and tensors, held to the live framework: shared by
the vLLM trainer engine (`RdmaPlanTrainerInitInfo(binding=...)`) and the SGLang trainer
side (`integrations.sglang_trainer.load_source`).

A trainer rank passes the `Binding` its adapter returns (`integrations.megatron.bind`,
`integrations.fsdp2.bind`): rank, identity and tensors derived together from the live
framework. Before anything is registered or written, the framework's live state is read
again (`Binding.live`; without a binding, an initialized Megatron `parallel_state` in this
process) and must select the plan rank this process loads: an identity handed over apart
from the tensors (a launcher's bug: two ranks each given the other's) is refused in one line
naming both. An identity that cannot be held to any live framework (no Megatron
`parallel_state`, a binding made by hand) is refused too: a process without a framework
passes `plan_rank=` with `no_identity=True`, which the executor logs.

A chunked plan (`schemas/chunked_plan.py`) takes the same path: `checked_parts` reads the
rank's part of every chunk and holds each to the identity, the live state to the rank, and
`load` returns the chunks' executors, which `executor.run_chunks` sends in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

import executor
from executor import trust
from schemas.chunked_plan import is_chunked, load_rank_chunks, plan_header
from schemas.errors import IdentityError
from schemas.header import PlanHeader
from schemas.identity import describe, find_rank
from schemas.integrity import plan_key as read_key
from schemas.plan import RankPlan, load_rank

from . import Binding, megatron

log = logging.getLogger(__name__)

Live = Callable[[PlanHeader, str], tuple[int, dict]]


def plan_rank(path: str, binding: Binding | None, identity: dict | None,
              plan_rank: int | None, rank: int, where: str) -> tuple[int, dict | None]:
    """(plan rank, identity) a trainer rank loads: the binding's; else `plan_rank`, else the
    rank the plan records `identity` for, else `rank`. A binding given with a keyword
    identity or plan rank that differs from it is refused."""
    if binding is not None:
        if identity is not None and dict(identity) != dict(binding.identity):
            raise IdentityError(f"{where}: identity= ({describe(identity)}) differs from the "
                                f"binding's ({describe(binding.identity)}); pass the binding "
                                "alone: its identity is read from the framework")
        if plan_rank is not None and plan_rank != binding.rank:
            raise IdentityError(f"{where}: plan_rank={plan_rank} but the binding is plan rank "
                                f"{binding.rank}; pass the binding alone")
        return binding.rank, dict(binding.identity)
    if plan_rank is not None:
        return plan_rank, identity
    if identity is not None:
        return int(find_rank(plan_header(path), identity, path)), identity
    return rank, None


def live(header: PlanHeader, binding: Binding | None) -> Live | None:
    """How to read this process's live framework state: the binding's own reader, else an
    initialized Megatron `parallel_state` (for a Megatron plan); None where there is none."""
    if binding is not None and binding.live is not None:
        return binding.live
    framework = header.source.framework if header.source is not None else None
    if framework == "megatron":
        return lambda h, path: megatron.live_rank(h, path) or (-1, {})
    return None


def check_live(header: PlanHeader, rank: int, identity: dict | None, path: str,
               binding: Binding | None, where: str) -> None:
    """Refuse (`IdentityError`, one line) a plan rank that this process's live framework
    state does not select, and an identity that no live state can be held to."""
    read = live(header, binding)
    got = read(header, path) if read is not None else None
    if got is None or got[0] < 0:
        if identity is None:
            return  # no identity: `executor.load` refuses it unless no_identity (logged)
        framework = header.source.framework if header.source is not None else "?"
        raise IdentityError(
            f"{where}: identity {describe(identity)} cannot be held to a live {framework} in "
            "this process (no binding from integrations.megatron/fsdp2.bind, no initialized "
            "Megatron parallel_state): pass binding=integrations."
            f"{'fsdp2' if framework == 'fsdp2' else 'megatron'}.bind(plan, model), whose "
            "identity and tensors come from the framework together; a process without a "
            "framework passes plan_rank= and no_identity=True (logged)")
    live_rank, live_identity = got
    if live_rank != rank:
        given = describe(identity) if identity is not None else "no identity"
        raise IdentityError(
            f"{where}: this process was handed plan rank {rank} ({given}) but its live "
            f"framework state is {describe(live_identity)}, plan rank {live_rank}: two ranks "
            "were mixed up; pass binding=integrations.megatron/fsdp2.bind(plan, model) "
            "instead of a separate identity")


def bound_tensors(binding: Binding | None, source_tensors: Callable[[], dict[str, torch.Tensor]]
                  | None, where: str) -> dict[str, torch.Tensor]:
    """The tensors the rank registers: the binding's (the live storage), or the source's."""
    if binding is not None:
        if source_tensors is not None:
            raise ValueError(f"{where}: both binding= and a source were given; with a binding "
                             "leave the source out: the binding's tensors are the live "
                             "storage the plan sends each update")
        return dict(binding.tensors)
    if source_tensors is None:
        raise ValueError(f"{where}: no tensors: pass binding= (integrations.megatron/fsdp2"
                         ".bind) or a source yielding this rank's plan tensors")
    return source_tensors()


Parts = list[tuple[PlanHeader, RankPlan]]


def checked_parts(path: str, rank: int, identity: dict | None, no_identity: bool,
                  plan_key: str | None, binding: Binding | None, where: str
                  ) -> tuple[bool, Parts]:
    """(whether the plan is chunked, rank `rank`'s part with its header: the plan's one, or
    one per chunk in order), each part's identity held to `identity`
    (`executor.trust.check_identity`, every chunk's) and the live framework state to the
    rank (`check_live`): refused in one line before anything is registered."""
    key = None if plan_key is None else read_key(plan_key)
    chunked = is_chunked(path)
    parts = load_rank_chunks(path, rank, key)[1] if chunked else [load_rank(path, rank, key)]
    for k, (header, part) in enumerate(parts):
        trust.check_identity(header, part.identity, rank, identity, no_identity,
                             f"{path} chunk {k}" if chunked else path)
    check_live(parts[0][0], rank, identity, path, binding, where)
    return chunked, parts


def load(path: str, rank: int, tensors: dict[str, torch.Tensor], chunked: bool,
         options: executor.LoadOptions) -> executor.Executor | list[executor.Executor]:
    """The rank's executor (`executor.run` sends a step), or for a chunked plan one per
    chunk (`executor.run_chunks` sends a step, chunk by chunk)."""
    if chunked:
        return executor.load_chunks(path, rank, tensors, options)
    return executor.load(path, rank, tensors, options)
