"""vLLM's process-wide parallel groups faked for one engine rank (`planner/layouts/
vllm_trace.py` builds each rank's model under them): sizes and ranks, no process group and
no communication. Imports vLLM only inside `fake_parallel_state`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from schemas.config import TargetConfig


class _ProcessGroup:
    """What vLLM asks of a `torch.distributed` group while building a model."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Group:
    """A stand-in for vLLM's `GroupCoordinator`: sizes and ranks, no communication."""

    def __init__(self, size: int, rank: int, name: str) -> None:
        self.world_size, self.rank_in_group, self.rank = size, rank, rank
        self.ranks, self.local_rank, self.unique_name = list(range(size)), rank, name
        self.device_group = self.cpu_group = _ProcessGroup(size, rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


_GROUPS = ("_WORLD", "_TP", "_PP", "_DP", "_EP", "_PCP", "_DCP")


@contextmanager
def fake_parallel_state(cfg: TargetConfig, d: int, p: int, t: int) -> Iterator[None]:
    """vLLM's process-wide groups for DP rank d, PP stage p, TP rank t; restored after."""
    from vllm.distributed import parallel_state as ps

    world = cfg.engine_world
    ep = (cfg.dp * cfg.tp, d * cfg.tp + t) if cfg.ep else (1, 0)
    groups = {"_WORLD": (world, (d * cfg.pp + p) * cfg.tp + t), "_TP": (cfg.tp, t),
              "_PP": (cfg.pp, p), "_DP": (cfg.dp, d), "_EP": ep, "_PCP": (1, 0),
              "_DCP": (1, 0)}
    saved = {g: getattr(ps, g) for g in _GROUPS}
    try:
        for g, (size, rank) in groups.items():
            setattr(ps, g, _Group(size, rank, g.lower()))
        yield
    finally:
        for g, old in saved.items():
            setattr(ps, g, old)
