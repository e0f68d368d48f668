"""Byte copies between torch regions, prepared once: the data path of `local` and `cuda_ipc`.

Writes of one (src region, dst region, size) group become one `index_select` +
`index_copy_` over byte-row views (`as_strided(region, (N, nbytes), (1, 1))`); large
writes are one slice copy each (a plain memcpy on CPU; on GPU, those below 16 MiB
together in one `_foreach_copy_` launch).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .base import WriteBatch

Op = Callable[[], None]
_BIG = 1 << 16  # writes of at least this many bytes are copied one slice each
_HUGE = 1 << 24  # on GPU, slices below this go together into one `_foreach_copy_`


def _slice_copy(dst: torch.Tensor, src: torch.Tensor) -> Op:
    if dst.is_cpu and src.is_cpu:  # a plain memcpy: torch's thread pool costs more than it
        d, s = dst.numpy(), src.numpy()  # gains per slice on a busy CPU

        def op() -> None:
            np.copyto(d, s)
        return op

    def op() -> None:
        dst.copy_(src)
    return op


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> Op:
    def op() -> None:
        torch._foreach_copy_(dst, src)
    return op


def _row_copy(dst: torch.Tensor, src: torch.Tensor, do: np.ndarray, so: np.ndarray,
              n: int) -> Op:
    s2 = src.as_strided((int(so.max()) + 1, n), (1, 1))
    d2 = dst.as_strided((int(do.max()) + 1, n), (1, 1))
    si, di = torch.from_numpy(so.copy()).to(src.device), torch.from_numpy(do.copy()).to(dst.device)

    def op() -> None:
        d2.index_copy_(0, di, s2.index_select(0, si))
    return op


def pair_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], few_below: int = _HUGE
                ) -> list[Op]:
    """(dst, src) copies of any dtype and strides as ops, under `no_grad` (a live parameter
    may require grad), the policy of `prepare_copies`' slices: on a GPU those below
    `few_below` bytes in one `_foreach_copy_` (a shadow's switch: `executor/switch.py`),
    each other one `copy_`."""
    def small(d: torch.Tensor) -> bool:
        return d.is_cuda and d.numel() * d.element_size() < few_below
    few = [(d, s) for d, s in pairs if small(d)]
    rest = [(d, s) for d, s in pairs if not small(d)]
    ops: list[Op] = []
    if few:
        dst, src = [d for d, _ in few], [s for _, s in few]

        def together() -> None:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        ops.append(together)
    for d, s in rest:
        def one(d: torch.Tensor = d, s: torch.Tensor = s) -> None:
            with torch.no_grad():
                d.copy_(s)
        ops.append(one)
    return ops


def prepare_copies(src_regions: list[torch.Tensor], dst_regions: list[torch.Tensor],
                   batch: WriteBatch) -> list[Op]:
    """The ops that perform `batch` from `src_regions` into `dst_regions` (flat uint8)."""
    ops: list[Op] = []
    cols = np.stack([batch.src_region, batch.dst_region, batch.nbytes], axis=1)
    big = batch.nbytes >= _BIG
    if src_regions and dst_regions and src_regions[0].device != dst_regions[0].device:
        big = batch.nbytes > 0  # index_copy_ needs both sides on one device: slices only
    slices = []
    for i in np.flatnonzero(big):
        so, do, n = int(batch.src_offset[i]), int(batch.dst_offset[i]), int(batch.nbytes[i])
        slices.append((dst_regions[cols[i, 1]][do:do + n], src_regions[cols[i, 0]][so:so + n]))
    # on GPU, writes below _HUGE are launch-bound: one `_foreach_copy_` launch for them all
    few = [(d, s) for d, s in slices if d.is_cuda and d.numel() < _HUGE]
    if few:
        ops.append(_foreach_copy([d for d, _ in few], [s for _, s in few]))
    ops += [_slice_copy(d, s) for d, s in slices if not (d.is_cuda and d.numel() < _HUGE)]
    small = np.flatnonzero(~big & (batch.nbytes > 0))
    if len(small):
        keys, inverse = np.unique(cols[small], axis=0, return_inverse=True)
        for g, (sr, dr, n) in enumerate(keys.tolist()):
            rows = small[inverse.reshape(-1) == g]
            ops.append(_row_copy(dst_regions[dr], src_regions[sr],
                                 batch.dst_offset[rows], batch.src_offset[rows], n))
    return ops
