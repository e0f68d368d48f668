"""The run-time-built kernels share one loader (`executor/nvrtc.py`): each kernel its own
per-device cache, and where it cannot be built, one warning naming it and what runs
instead, then None (the caller's slower path)."""

from __future__ import annotations

import warnings

import pytest
import torch

from executor.gpu.copy_kernel import CopyKernel
from executor.gpu.quant_kernel import QuantKernel, RowsQuantKernel


def test_each_kernel_keeps_its_own_cache() -> None:
    assert CopyKernel._cache is not QuantKernel._cache
    assert CopyKernel._lock is not QuantKernel._lock
    assert RowsQuantKernel._cache is not QuantKernel._cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds for real where CUDA is")
@pytest.mark.parametrize("kernel,fallback", [(CopyKernel, "copy engines"),
                                             (QuantKernel, "box by box"),
                                             (RowsQuantKernel, "element by element")])
def test_a_kernel_that_cannot_be_built_warns_once_and_gives_none(kernel, fallback) -> None:
    kernel._cache.clear()
    if getattr(torch.cuda, "_compile_kernel", None) is None:
        pytest.skip("this torch has no _compile_kernel: load is None without a warning")
    with pytest.warns(UserWarning, match=f"{kernel.NAME} kernel could not be built.*{fallback}"):
        assert kernel.load(torch.device("cuda", 0)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.load(torch.device("cuda", 0)) is None  # cached: no second warning
    assert 0 in kernel._cache and len(kernel._cache) == 1
    kernel._cache.clear()
