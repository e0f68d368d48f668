"""Bind the caller's tensors to a rank's regions: names, shapes, dtypes, contiguity.

Every problem is collected and reported in one `BindError`. Tensors the plan does not
name are ignored. The staging region (`STAGING`) is allocated here, on the tensors' device.
The result is one flat `uint8` view per region: the bytes the transports register.
"""

from __future__ import annotations

import torch

from schemas.plan import STAGING, Region

from .errors import BindError


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BindError(f"dtype {name!r} is not a torch dtype")
    return dt


def _problem(region: Region, t: torch.Tensor | None) -> str | None:
    if t is None:
        return f"  {region.name}: missing (the plan expects {region.dtype} {list(region.shape)})"
    if not isinstance(t, torch.Tensor):
        return f"  {region.name}: is a {type(t).__name__}, not a torch.Tensor"
    wrong = []
    if tuple(t.shape) != region.shape:
        wrong.append(f"shape {list(t.shape)} != plan {list(region.shape)}")
    if t.dtype != torch_dtype(region.dtype):
        wrong.append(f"dtype {str(t.dtype).removeprefix('torch.')} != plan {region.dtype}")
    if not t.is_contiguous():
        wrong.append("not contiguous (pass .contiguous() storage that the model keeps using)")
    if not wrong and t.numel() * t.element_size() != region.nbytes:
        wrong.append(f"{t.numel() * t.element_size()} bytes != plan {region.nbytes}")
    return f"  {region.name}: " + "; ".join(wrong) if wrong else None


def bind(rank: int, regions: tuple[Region, ...], tensors: dict[str, torch.Tensor],
         device: torch.device | None = None) -> list[torch.Tensor]:
    """One flat uint8 view per region (staging allocated), or `BindError` listing all problems."""
    problems = [p for r in regions if r.name != STAGING
                if (p := _problem(r, tensors.get(r.name))) is not None]
    bound = [t for r in regions if isinstance(t := tensors.get(r.name), torch.Tensor)]
    devices = {t.device for t in bound}
    if len(devices) > 1:
        problems.append(f"  tensors are on several devices {sorted(map(str, devices))}; "
                        "a rank's regions must share one device")
    if problems:
        raise BindError(f"rank {rank}: {len(problems)} tensor(s) do not match the plan:\n"
                        + "\n".join(problems))
    device = device or (bound[0].device if bound else torch.device("cpu"))
    views = []
    for r in regions:
        if r.name == STAGING:
            views.append(torch.zeros(r.nbytes, dtype=torch.uint8, device=device))
        else:
            views.append(tensors[r.name].detach().reshape(-1).view(torch.uint8))
    return views


def typed(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat uint8 region viewed as `dtype` (a trailing partial element is dropped)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return u8[: u8.numel() // itemsize * itemsize].view(dtype)
