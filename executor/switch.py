"""A shadow's switch: one chunk's shadow -> live copies as ONE launch on a GPU.

A switch is many copies (one per tensor, or per byte range the plan's switch ops name).
As eager `copy_` calls each pays the host's launch cost (10-20 us), so a 64 MiB target of
8 tensors spent 3.4-3.8x the time one copy of its bytes takes (issue 36's GPU figures, one
H200). On a GPU each chunk is built once, at attach, into one launch on the caller's
current stream (the engine's: its next decode step is ordered after it):
- up to `MANY` copies: their `copy_`s captured as one CUDA graph (`transports/graphs.py`),
  replayed: torch's copy kernel, at the device's local copy bandwidth;
- more (a plan's switch ops of many small byte ranges): one launch of the batched copy
  kernel (`transports/copy_kernel.py`) over a piece table, pieces cut so the grid fills
  the device (one `copy_` node per range would cost more than its bytes). On one H200 that
  kernel moved 512 MiB at half `copy_`'s rate, so it is not the choice for few large ones.
Elsewhere (CPU; a capture that fails) the chunk is its `copy_`s one by one. Every live
`data_ptr` stays either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .transports.copy_kernel import CHUNK, CopyKernel, piece_table
from .transports.graphs import as_graph

Pair = tuple[torch.Tensor, torch.Tensor]
MIN_PIECE = 1 << 15
"""Smallest piece (bytes) when cutting a switch to fill the grid."""
MANY = 256
"""More copies than this in a chunk: the copy kernel instead of a graph of `copy_`s."""


def piece_bytes(total: int, blocks: int) -> int:
    """The piece size that gives each of `blocks` blocks about four pieces of `total`
    bytes: between MIN_PIECE and the copy kernel's CHUNK, a multiple of 16."""
    want = total // max(4 * blocks, 1)
    return max(MIN_PIECE, min(CHUNK, want // 16 * 16))


class SwitchCopies:
    """Per chunk, its (dst, src) pairs; `copy(k)` queues chunk k, `sync()` waits for it."""

    def __init__(self, chunks: list[list[Pair]], what: str = "shadow switch") -> None:
        self.chunks = chunks
        pairs = [p for chunk in chunks for p in chunk]
        devices = {t.device for p in pairs for t in p}
        self.devices = [d for d in devices if d.type == "cuda"]
        one = self.devices[0] if len(devices) == 1 and self.devices else None
        self.launch: list[list[Callable[[], None]] | None] = []
        """Per chunk: its one launch on a GPU (a graph's replay, or the kernel's), else
        None (eager `copy_`s)."""
        self.kind: list[str] = []
        """Per chunk: `graph`, `kernel` or `eager`."""
        self._tables: list[torch.Tensor] = []  # the kernel reads them: keep them alive
        for k, chunk in enumerate(chunks):
            ops, kind = None, "eager"
            if one is not None and chunk:
                if len(chunk) > MANY and all(_flat(d, s) for d, s in chunk):
                    ops, kind = self._kernel(one, chunk), "kernel"
                if ops is None:
                    ops = as_graph([_copy(d, s) for d, s in chunk], one, f"{what} chunk {k}")
                    kind = "graph" if len(ops) == 1 else "eager"
                    ops = ops if len(ops) == 1 else None
            self.launch.append(ops)
            self.kind.append(kind)

    @property
    def one_launch(self) -> bool:
        """True where every non-empty chunk is one launch."""
        return bool(self.devices) and all(
            ops is not None for ops, c in zip(self.launch, self.chunks) if c)

    def _kernel(self, device: torch.device, chunk: list[Pair]
                ) -> list[Callable[[], None]] | None:
        kernel = CopyKernel.load(device)
        if kernel is None:
            return None
        dst = np.array([d.data_ptr() for d, _ in chunk], dtype=np.int64)
        src = np.array([s.data_ptr() for _, s in chunk], dtype=np.int64)
        n = np.array([d.numel() * d.element_size() for d, _ in chunk], dtype=np.int64)
        piece = piece_bytes(int(n.sum()), kernel.max_blocks)
        table = torch.from_numpy(piece_table(dst, src, n, piece)).to(device)
        self._tables.append(table)

        def go() -> None:
            with torch.cuda.device(device):
                kernel.launch(table)
        return [go]

    def copy(self, k: int) -> None:
        """Queue chunk k's copies (on the current stream where on a GPU)."""
        ops = self.launch[k]
        with torch.no_grad():
            if ops is not None:
                for op in ops:
                    op()
            else:
                for d, s in self.chunks[k]:
                    d.copy_(s)

    def sync(self) -> None:
        """Wait until the queued copies are done (the engine may read the live tensors)."""
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def op() -> None:
        with torch.no_grad():  # a live parameter may require grad
            dst.copy_(src)
    return op


def _flat(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() == src.numel())
