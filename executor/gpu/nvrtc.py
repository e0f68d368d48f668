"""A CUDA kernel built at run time with NVRTC (`torch.cuda._compile_kernel`: no compiler,
no extension build), once per process and device; the copy kernel and the FP8 quantizer
kernel are two.

Where it cannot be built (a torch without `_compile_kernel`, no NVRTC, no driver entry),
`load` warns once and returns None, and the caller keeps its slower path.
"""

from __future__ import annotations

import threading
import warnings
from typing import ClassVar

import torch


class RuntimeKernel:
    """One compiled kernel of one device. A subclass names its `SOURCE`, `NAME` (the
    `extern "C"` function), `BLOCKS_PER_SM` and `FALLBACK` (what runs instead, for the
    warning); `fn` is the launchable, `max_blocks` the grid that fills the device."""

    SOURCE: ClassVar[str]
    NAME: ClassVar[str]
    BLOCKS_PER_SM: ClassVar[int]
    FALLBACK: ClassVar[str]
    _cache: ClassVar[dict[int, RuntimeKernel | None]]
    _lock: ClassVar[threading.Lock]

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls._cache, cls._lock = {}, threading.Lock()  # one per kernel, not shared

    def __init__(self, fn: object, device: torch.device) -> None:
        self.fn, self.device = fn, device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_blocks = sms * self.BLOCKS_PER_SM

    @classmethod
    def load(cls, device: torch.device):  # -> Self | None
        """The kernel for `device` (built once per process), or None where it cannot be."""
        index = torch.device(device).index or 0
        with cls._lock:
            if index not in cls._cache:
                cls._cache[index] = cls._build(torch.device("cuda", index))
            return cls._cache[index]

    @classmethod
    def _build(cls, device: torch.device) -> RuntimeKernel | None:
        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None:
            return None
        try:
            with torch.cuda.device(device):
                return cls(compile_kernel(cls.SOURCE, cls.NAME), device)
        except Exception as e:  # noqa: BLE001 - no NVRTC, no driver entry: the slower path
            warnings.warn(f"{device}: the {cls.NAME} kernel could not be built ({e}); "
                          f"{cls.FALLBACK}", stacklevel=4)
            return None
