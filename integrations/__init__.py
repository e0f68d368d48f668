"""Framework adapters: a live framework process -> its plan rank, identity and tensors.

Each adapter derives the caller's identity (`schemas/identity.py`) from the framework's own
parallel state, finds the plan rank with that identity, and returns exactly the tensors
that rank binds (`schemas/tensors.py`), checked by name, shape, dtype and contiguity:

    b = integrations.megatron.bind("plan.rplan", model_chunks)
    plan = executor.load("plan.rplan", rank=b.rank, tensors=b.tensors, identity=b.identity,
                         rendezvous=...)

A chunked plan (`target.shadow: {budget_bytes: N}`) binds the same way (its chunks' union
of the rank's tensors) and is sent with `executor.load_chunks(...)` and
`executor.run_chunks(chunks)`; `integrations.trainer.load` picks one or the other.

Adapters read plans through `schemas` only (never planner internals).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from schemas.header import PlanHeader
from schemas.tensors import RankTensors

from .errors import ModelMismatchError

__all__ = ["Binding", "ModelMismatchError", "match", "tensor_sha256"]


@dataclass(frozen=True)
class Binding:
    rank: int
    """The plan rank this process runs."""
    identity: dict[str, int | str]
    """This process's coordinates; pass it to `executor.load(identity=...)`."""
    tensors: dict[str, torch.Tensor]
    """Exactly the tensors the plan's rank binds, by native name (the live storage)."""
    live: Callable[[PlanHeader, str], tuple[int, dict[str, int | str]]] | None = field(
        default=None, repr=False, compare=False)
    """Re-reads the framework's live state (Megatron's `parallel_state`, the DTensors'
    meshes): (the plan rank it selects in a plan, its identity). The trainer paths
    (`integrations.trainer`) hold `rank` and `identity` to it before anything is written,
    so a binding whose identity was replaced, or one made by hand, cannot drift from the
    process it runs in."""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in row-major order (vLLM's weight checker's digest;
    the engine-side digests of `integrations.sglang`; `harness.weights.layout_digests`, what
    an engine laid out by a layout must hold)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw).hexdigest()


_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8"}


def match(expected: RankTensors, live: dict[str, torch.Tensor], path: str,
          hint: Callable[[list[str], list[str]], str] = lambda missing, extra: "",
          ignore_extra: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """The live tensors the plan's rank binds; `ModelMismatchError` listing every mismatch
    (missing names, unexpected parameters, shapes, dtypes, non-contiguous storage), with
    the framework's `hint` about the config key to change."""
    out, problems, wrong_dtype = {}, [], []
    missing = [t.name for t in expected.tensors if t.name not in live]
    names = {t.name for t in expected.tensors}
    extra = [n for n in live if n not in names and not ignore_extra(n)]
    for t in expected.tensors:
        x = live.get(t.name)
        if x is None:
            continue
        dtype = _DTYPES.get(x.dtype, str(x.dtype).replace("torch.", ""))
        if tuple(x.shape) != t.shape:
            problems.append(f"{t.name}: shape {tuple(x.shape)}, the plan has {t.shape}")
        elif dtype != t.dtype:
            problems.append(f"{t.name}: dtype {dtype}, the plan has {t.dtype}")
            wrong_dtype.append(t.dtype)
        elif not x.is_contiguous():
            problems.append(f"{t.name}: not contiguous (strides {tuple(x.stride())}); the "
                            "plan writes raw bytes: pass contiguous storage")
        out[t.name] = x
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the plan are not in the model, e.g. "
                        f"{', '.join(missing[:3])}")
    if extra:
        problems.append(f"{len(extra)} model tensor(s) are not in the plan (they would not be "
                        f"transferred), e.g. {', '.join(extra[:3])}")
    if problems:
        fix = "; ".join(f for f in (dtype_fix(wrong_dtype, live, expected), hint(missing, extra))
                        if f)
        raise ModelMismatchError(
            f"{path}: plan rank {expected.rank} ({_ident(expected)}) does not match this "
            f"model: {len(problems)} problem(s); {'; '.join(problems[:8])}"
            f"{'; ' + fix if fix else ''}. Compile the plan for this model's layout "
            f"(`rdma-plan tensors {path} --rank {expected.rank}` lists what it expects)")
    return out


def dtype_fix(wrong: list[str], live: dict[str, torch.Tensor], expected: RankTensors) -> str:
    """The one fix for dtype mismatches: recompile for the model's dtype when the model has
    one; when it mixes dtypes (fp32 norms beside bf16 linears, as mixed precision without
    `Float16Module` leaves them), no `source.dtype` fits: cast the model to one dtype."""
    if not wrong:
        return ""
    have: dict[str, int] = {}
    for t in expected.tensors:
        x = live.get(t.name)
        if x is not None:
            d = _DTYPES.get(x.dtype, str(x.dtype).replace("torch.", ""))
            have[d] = have.get(d, 0) + 1
    plan = sorted(set(wrong))
    if len(have) == 1:
        (d,) = have
        return f"compile with source.dtype: {d}, or pass the {'/'.join(plan)} tensors"
    mix = ", ".join(f"{n} {d}" for d, n in sorted(have.items(), key=lambda kv: -kv[1]))
    return (f"the model mixes dtypes ({mix}) and a plan has one source dtype, so no "
            f"source.dtype fits: bind parameters of one dtype (the plan's {'/'.join(plan)}: "
            "cast the model, e.g. Megatron's Float16Module with bf16=True as mixed-precision "
            "training does), or cast every parameter to one dtype and compile with that "
            "source.dtype")


def _ident(rt: RankTensors) -> str:
    from schemas.identity import describe

    return describe(rt.identity) if rt.identity else "no identity"
