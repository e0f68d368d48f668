"""A shadow's switch: one chunk's shadow -> live copies in ONE launch on a GPU.

A switch is many copies (one per tensor, or per byte range the plan's switch ops name).
As `copy_` calls each pays the host's launch cost, so a 64 MiB target of 8 tensors spent
3.4x the time one copy of its bytes takes (issue 36's first GPU figures, one H200). On a
GPU the switch is a table of (dst, src, nbytes) pieces built once at attach and copied by
the batched copy kernel (`transports/copy_kernel.py`) in one launch per chunk, on the
caller's current stream (the engine's: its next decode step is ordered after it). Pieces
are cut small enough that the grid fills the device. Elsewhere (CPU; a GPU where the
kernel does not build; tensors not contiguous, or not all on one device) it is one
`torch._foreach_copy_` per chunk. Every live `data_ptr` stays either way.
"""

from __future__ import annotations

import numpy as np
import torch

from .transports.copy_kernel import CHUNK, CopyKernel, piece_table

Pair = tuple[torch.Tensor, torch.Tensor]
MIN_PIECE = 1 << 15
"""Smallest piece (bytes) when cutting a switch to fill the grid."""


def piece_bytes(total: int, blocks: int) -> int:
    """The piece size that gives each of `blocks` blocks about four pieces of `total`
    bytes: between MIN_PIECE and the copy kernel's CHUNK, a multiple of 16."""
    want = total // max(4 * blocks, 1)
    return max(MIN_PIECE, min(CHUNK, want // 16 * 16))


class SwitchCopies:
    """Per chunk, its (dst, src) pairs; `copy(k)` queues chunk k, `sync()` waits for it."""

    def __init__(self, chunks: list[list[Pair]]) -> None:
        self.chunks = chunks
        self.kernel: CopyKernel | None = None
        self.tables: list[torch.Tensor] = []
        pairs = [p for chunk in chunks for p in chunk]
        devices = {t.device for p in pairs for t in p}
        self.devices = [d for d in devices if d.type == "cuda"]
        if len(devices) == 1 and self.devices and all(_flat(d, s) for d, s in pairs):
            self.kernel = CopyKernel.load(self.devices[0])
        if self.kernel is not None:
            self.tables = [self._table(chunk) for chunk in chunks]

    @property
    def one_launch(self) -> bool:
        """True where each chunk is one kernel launch."""
        return self.kernel is not None

    def _table(self, chunk: list[Pair]) -> torch.Tensor:
        assert self.kernel is not None
        dst = np.array([d.data_ptr() for d, _ in chunk], dtype=np.int64)
        src = np.array([s.data_ptr() for _, s in chunk], dtype=np.int64)
        n = np.array([d.numel() * d.element_size() for d, _ in chunk], dtype=np.int64)
        piece = piece_bytes(int(n.sum()), self.kernel.max_blocks)
        return torch.from_numpy(piece_table(dst, src, n, piece)).to(self.kernel.device)

    def copy(self, k: int) -> None:
        """Queue chunk k's copies (on the current stream where on a GPU)."""
        with torch.no_grad():
            if self.kernel is not None:
                with torch.cuda.device(self.kernel.device):
                    self.kernel.launch(self.tables[k])
            elif self.chunks[k]:
                torch._foreach_copy_([d for d, _ in self.chunks[k]],
                                     [s for _, s in self.chunks[k]])

    def sync(self) -> None:
        """Wait until the queued copies are done (the engine may read the live tensors)."""
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()


def _flat(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() == src.numel())
