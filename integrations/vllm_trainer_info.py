"""The trainer side's init info and source iteration of the vLLM backend (`integrations.vllm`
re-exports both; split out to keep that module readable in one sitting)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightSource

from schemas.identity import find_rank
from schemas.plan import read_header

BACKEND = "rdma_plan"


@dataclass
class RdmaPlanTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    plan: str
    """Path of the compiled plan file (the same file the workers load)."""
    rendezvous: str
    """`host:port` of the plan's store; plan rank 0 (the sender) hosts it."""
    transport: str = "nixl"
    timeout_s: float = 60.0
    plan_rank: int | None = None
    """This trainer rank's plan rank (default: the plan rank whose identity is `identity`)."""
    identity: dict[str, int | str] | None = None
    """This trainer rank's coordinates from its framework (`integrations.megatron.identity()`,
    `integrations.fsdp2.identity(model)`, or a bind's `b.identity`): the plan rank is the
    one with this identity, and a part compiled for another is refused before anything is
    registered. Without it the load is refused unless `no_identity=True` (logged)."""
    no_identity: bool = False
    """Trust `plan_rank` (or `rank`) without an identity (logged)."""
    plan_key: str | None = None
    """Path of the plan's signing key, on the trainer and (the same path) on every worker;
    with a job secret set, required unless `allow_unsigned`."""
    allow_unsigned: bool = False
    """Load without checking the plan's signature although a job secret is set (logged)."""
    shadow: bool = False
    """The workers' shadow mode (`RdmaPlanInitInfo.shadow`)."""

    def worker_info(self) -> dict[str, Any]:
        return {"plan": self.plan, "rendezvous": self.rendezvous, "shadow": self.shadow,
                "transport": self.transport, "timeout_s": self.timeout_s,
                "plan_key": self.plan_key, "allow_unsigned": self.allow_unsigned}

    def load_rank(self) -> int:
        """The plan rank this trainer rank loads: `plan_rank`, else the one whose identity
        is `identity`, else `rank` (only with `no_identity`: `executor.load` refuses it)."""
        if self.plan_rank is not None:
            return self.plan_rank
        if self.identity is not None:
            with open(self.plan, "rb") as f:
                header = read_header(f, self.plan)[0]
            return int(find_rank(header, self.identity, self.plan))
        return self.rank


def source_tensors(source: WeightSource) -> dict[str, torch.Tensor]:
    """This rank's tensors from `source`: `iter_local()` where implemented, else `iter_full()`
    (vLLM 0.33); vLLM 0.32's `WeightSource` has neither: iterating it yields them."""
    if not hasattr(source, "implements_iter_local"):  # vLLM 0.32
        it = iter(source)
    else:
        it = source.iter_local() if source.implements_iter_local() else source.iter_full()
    return {name: t.detach() for name, t in it}
