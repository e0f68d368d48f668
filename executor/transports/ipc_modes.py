"""How `cuda_ipc` posts a batch (`Mode`, best first) and the one way it goes down
(`Ladder.degrade`): every step down, at start (something this process lacks) or later (a
call failed), is recorded with its reason; a step down after start is warned once. Nothing
ever goes back up."""

from __future__ import annotations

import warnings
from enum import IntEnum


class Mode(IntEnum):
    """How a batch is posted; a lower mode needs less of the CUDA runtime."""

    TORCH = 0
    """torch copies on the batch's stream (`torch_copy.py`): no CUDA runtime library in this
    process, or one of its calls failed."""
    RUNTIME = 1
    """A CUDA graph replayed (copy kernel or copy engines) or one `cudaMemcpyAsync` per copy,
    queued through torch's stream objects."""
    FAST = 2
    """The same as runtime calls on raw handles made at prepare (`ipc_posted.FastPost`)."""


STEPS: dict[str, tuple[Mode | None, str]] = {
    "copy_kernel": (None, "batches prepared from now on go to the copy engines"),
    "fast_post": (Mode.RUNTIME, "batches are posted through torch's stream objects"),
    "runtime": (Mode.TORCH, "batches run as torch copies"),
}
"""What can be turned off: the mode it leaves at most (None: the mode stays, the copy kernel
goes), and what that means for the batches."""


class Ladder:
    """The posting mode of one `cuda_ipc` transport, whether it may use the copy kernel,
    and why each of the two went down (`degraded`: (what, why) pairs, in order)."""

    def __init__(self, rank: int, kernel: bool) -> None:
        self.rank = rank
        self.mode = Mode.FAST
        self._kernel = kernel
        self.degraded: list[tuple[str, str]] = []

    @staticmethod
    def at_start(rank: int, copy_kernel: bool, runtime: bool, raw_posts: bool,
                 kernel_built: bool) -> Ladder:
        """The ladder of a transport just built (`copy_kernel`: asked for), down from the top
        past what this process lacks: recorded in `degraded`, not warned."""
        ladder = Ladder(rank, copy_kernel)
        if not runtime:
            ladder.degrade("runtime", "no libcudart in this process", warn=False)
        if not raw_posts:
            ladder.degrade("fast_post", "this torch has no raw stream or graph handles",
                           warn=False)
        if not kernel_built:
            ladder.degrade("copy_kernel", "it does not build on this device", warn=False)
        return ladder

    @property
    def kernel(self) -> bool:
        """Batches prepared now may be one launch of the copy kernel (it needs the runtime)."""
        return self._kernel and self.mode >= Mode.RUNTIME

    def degrade(self, what: str, why: str, warn: bool = True) -> bool:
        """Turn `what` (a key of `STEPS`) off for good, because of `why`; whether that changed
        anything (turning off what is off already records nothing). `warn`: say so once,
        as a warning (False at start: the process simply lacks it)."""
        if what not in STEPS:
            raise ValueError(f"cuda_ipc cannot turn off {what!r}; it turns off one of "
                             f"{', '.join(STEPS)}")
        to, means = STEPS[what]
        before = (self.mode, self.kernel)
        if to is None:
            self._kernel = False
        else:
            self.mode = min(self.mode, to)
        if (self.mode, self.kernel) == before:
            return False
        self.degraded.append((what, why))
        if warn:
            warnings.warn(f"rank {self.rank}: cuda_ipc turned {what} off ({why}); {means}",
                          stacklevel=3)
        return True
