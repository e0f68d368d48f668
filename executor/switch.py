"""A shadow's switch: one chunk's shadow -> live copies as ONE launch on a GPU.

A switch is many copies (one per tensor, or per byte range the plan's switch ops name).
As eager `copy_` calls each pays the host's launch cost, so a switch of a few MiB per tensor
takes several times one copy of its bytes (BENCHMARKS.md has the figures). On a GPU each
chunk is built once, at attach, into one launch on the caller's current stream (the
engine's: its next decode step is ordered after it):
- up to `MANY` copies: captured as one CUDA graph (`gpu/graphs.py`) and replayed:
  one `_foreach_copy_` of those below `FEW_BELOW`, a `copy_` of each larger one
  (`transports/torch_copy.pair_copies`), at the device's local copy bandwidth;
- more (a plan's switch ops of many small byte ranges): one launch of the batched copy
  kernel (`gpu/copy_kernel.py`) over a piece table, pieces cut so the grid fills
  the device (one `copy_` node per range would cost more than its bytes). The kernel moves
  large ranges slower than `copy_` does, so it is not the choice for few large ones.
Elsewhere (CPU; a capture that fails) the same ops run eagerly. Every live
`data_ptr` stays either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .gpu.copy_kernel import CHUNK, CopyKernel, piece_table
from .gpu.graphs import Replay, as_graph
from .transports.torch_copy import pair_copies

Pair = tuple[torch.Tensor, torch.Tensor]
MIN_PIECE = 1 << 15
"""Smallest piece (bytes) when cutting a switch to fill the grid."""
FEW_BELOW = 1 << 20
"""Copies below this many bytes go together in one `_foreach_copy_` node of a chunk's
graph; each larger one is a `copy_` node (at that size a graph of `copy_`s is no slower
than one `_foreach_copy_` of them)."""
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
        self.launch: list[list[Callable[[], None]]] = []
        """Per chunk: its ops: on a GPU one launch (a graph's replay, or the kernel's)."""
        self.kind: list[str] = []
        """Per chunk: `graph`, `kernel` or `eager` (CPU, a failed capture, or empty)."""
        self._tables: list[torch.Tensor] = []  # the kernel reads them: keep them alive
        for k, chunk in enumerate(chunks):
            ops, kind = pair_copies(chunk, FEW_BELOW), "eager"
            if one is not None and chunk:
                fast = None
                if len(chunk) > MANY and all(_flat(d, s) for d, s in chunk):
                    fast, kind = self._kernel(one, chunk), "kernel"
                if fast is None:
                    fast = as_graph(ops, one, f"{what} chunk {k}")
                    kind = "graph" if isinstance(fast[0], Replay) else "eager"
                ops = fast
            self.launch.append(ops)
            self.kind.append(kind)

    @property
    def one_launch(self) -> bool:
        """True where every non-empty chunk is one launch."""
        return bool(self.devices) and all(
            kind != "eager" for kind, c in zip(self.kind, self.chunks) if c)

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
        for op in self.launch[k]:
            op()

    def sync(self) -> None:
        """Wait until the queued copies are done (the engine may read the live tensors)."""
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()


def _flat(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() == src.numel())
