"""The trainer side's init info and source iteration of the vLLM backend (`integrations.vllm`
re-exports both; split out to keep that module readable in one sitting)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightSource

from integrations import Binding, trainer

BACKEND = "rdma_plan"


@dataclass
class RdmaPlanTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    plan: str
    """Path of the compiled plan file (the same file the workers load)."""
    rendezvous: str
    """`host:port` of the plan's store; plan rank 0 (the sender) hosts it."""
    rendezvous_hosted: bool = False
    """A store already runs at `rendezvous` (the launcher's, e.g. one the job hosts before
    vLLM starts): every trainer rank and worker connects to it as a client
    (`executor.connect_store`); none hosts one, so no port has to be found free first."""
    transport: str = "nixl"
    timeout_s: float = 60.0
    binding: Binding | None = None
    """What this trainer rank sends: the `Binding` its adapter returns
    (`integrations.megatron.bind(plan, model)`, `integrations.fsdp2.bind(plan, model)`):
    plan rank, identity and the live tensors, derived together from the framework and read
    again at `trainer_init` (`integrations.trainer`). With it, pass no `source`."""
    plan_rank: int | None = None
    """This trainer rank's plan rank (default: the binding's, else the plan rank whose
    identity is `identity`)."""
    identity: dict[str, int | str] | None = None
    """Without a binding: this trainer rank's coordinates, held to the live framework state
    (an initialized Megatron `parallel_state`) and refused where it disagrees or where no
    live state can be read (pass `binding=`). A part compiled for another identity is
    refused before anything is registered."""
    no_identity: bool = False
    """A process without a framework: trust `plan_rank` (or `rank`) without an identity
    (logged); live framework state, where there is some, must still select that rank."""
    plan_key: str | None = None
    """Path of the plan's signing key, on the trainer and (the same path) on every worker;
    with a job secret set, required unless `allow_unsigned`."""
    allow_unsigned: bool = False
    """Load without checking the plan's signature although a job secret is set (logged)."""
    shadow: bool = False
    """The workers' shadow mode (`RdmaPlanInitInfo.shadow`)."""

    def worker_info(self) -> dict[str, Any]:
        return {"plan": self.plan, "rendezvous": self.rendezvous,
                "rendezvous_hosted": self.rendezvous_hosted, "shadow": self.shadow,
                "transport": self.transport, "timeout_s": self.timeout_s,
                "plan_key": self.plan_key, "allow_unsigned": self.allow_unsigned}

    def load_rank(self) -> int:
        """The plan rank this trainer rank loads: the binding's, `plan_rank`, else the one
        whose identity is `identity`, else `rank` (only with `no_identity`: `executor.load`
        refuses it)."""
        return self.load_identity()[0]

    def load_identity(self) -> tuple[int, dict[str, int | str] | None]:
        """(plan rank, identity) this trainer rank loads (`load_rank`)."""
        return trainer.plan_rank(self.plan, self.binding, self.identity, self.plan_rank,
                                 self.rank, self.where())

    def where(self) -> str:
        return f"rdma_plan trainer rank {self.rank} ({self.plan})"


def source_tensors(source: WeightSource) -> dict[str, torch.Tensor]:
    """This rank's tensors from `source`: `iter_local()` where implemented, else `iter_full()`
    (vLLM 0.33); vLLM 0.32's `WeightSource` has neither: iterating it yields them."""
    if not hasattr(source, "implements_iter_local"):  # vLLM 0.32
        it = iter(source)
    else:
        it = source.iter_local() if source.implements_iter_local() else source.iter_full()
    return {name: t.detach() for name, t in it}
