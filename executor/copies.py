"""PACK/UNPACK copies, prepared once into a few vectorised torch ops per stage.

Copies with the same regions, dtypes, strides and box sizes form one group: both regions
are viewed as 4-d strided tensors whose leading dim steps one element (`as_strided(...,
(N, size0, size1, size2), (1, stride0, stride1, stride2))`), so the group is one
`index_select` of the src boxes and one `index_copy_` into the dst boxes (casting in
between: fp32 -> bf16 through torch rounds to nearest even). A group of one is a plain
`dst.copy_(src)` of two strided views.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from schemas.plan import COPY_GROUP_KEY, DTYPE_CODES, Table

from .bind import torch_dtype, typed

Op = Callable[[], None]
_KEY = COPY_GROUP_KEY


def _one(src: torch.Tensor, dst: torch.Tensor, size: tuple[int, ...], sst: tuple[int, ...],
         dst_st: tuple[int, ...], so: int, do: int) -> Op:
    s = src.as_strided(size, sst, src.storage_offset() + so)
    d = dst.as_strided(size, dst_st, dst.storage_offset() + do)

    def op() -> None:
        d.copy_(s)
    return op


def _group(src: torch.Tensor, dst: torch.Tensor, size: tuple[int, ...], sst: tuple[int, ...],
           dst_st: tuple[int, ...], so: np.ndarray, do: np.ndarray) -> Op:
    s4 = src.as_strided((int(so.max()) + 1, *size), (1, *sst))
    d4 = dst.as_strided((int(do.max()) + 1, *size), (1, *dst_st))
    si = torch.from_numpy(so.astype(np.int64)).to(src.device)
    di = torch.from_numpy(do.astype(np.int64)).to(dst.device)

    def op() -> None:
        d4.index_copy_(0, di, s4.index_select(0, si).to(d4.dtype))
    return op


def prepare_copies(copies: Table, rows: np.ndarray, regions: list[torch.Tensor]) -> list[Op]:
    """The ops that perform copies `rows` of `copies` over the flat uint8 `regions`."""
    if not len(rows):
        return []
    cols = np.stack([copies[k][rows].astype(np.int64) for k in _KEY], axis=1)
    nonempty = cols[:, -3:].min(axis=1) > 0
    rows, cols = rows[nonempty], cols[nonempty]
    keys, inverse = np.unique(cols, axis=0, return_inverse=True)
    ops = []
    for g, key in enumerate(keys.tolist()):
        sr, sd, *sst = key[0:5]
        dr, dd, *dst_st = key[5:10]
        size = tuple(key[10:13])
        src = typed(regions[sr], torch_dtype(DTYPE_CODES[sd]))
        dst = typed(regions[dr], torch_dtype(DTYPE_CODES[dd]))
        members = rows[inverse.reshape(-1) == g]
        so, do = copies["src_offset"][members], copies["dst_offset"][members]
        if len(members) == 1:
            ops.append(_one(src, dst, size, tuple(sst), tuple(dst_st), int(so[0]), int(do[0])))
        else:
            ops.append(_group(src, dst, size, tuple(sst), tuple(dst_st), so, do))
    return ops
