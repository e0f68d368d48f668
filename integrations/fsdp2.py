"""FSDP2 adapter: a module sharded with `fully_shard` -> plan rank, identity and shards.

    b = integrations.fsdp2.bind("plan.rplan", model)     # after fully_shard(...)
    plan = executor.load("plan.rplan", rank=b.rank, tensors=b.tensors, identity=b.identity,
                         rendezvous=..., secret=...)

- identity: the rank's coordinates in the DeviceMesh `("dp_replicate", "dp_shard", "tp")`
  (`schemas/identity.py`), read from the parameters' own DTensor meshes (HSDP meshes
  `(dp_replicate, dp_shard)`, FSDP2+TP meshes with a `tp` dim; a 1-d mesh without names is
  `dp_shard`); dims the job does not have are 0. `mesh=` overrides it.
- tensors: each DTensor parameter's `to_local()` shard (the live storage), plain tensors
  and the buffers the plan lists as they are.
- checks: every `Shard(d)` placement follows the `torch.chunk` rule (chunk
  `ceil(n/W)`, trailing ranks may be empty) and the shard starts where the plan's box does
  (torch's own `compute_local_shape_and_global_offset`); shards are contiguous; names,
  shapes and dtypes equal the plan's (`ModelMismatchError` lists every problem).

FSDP2 keeps sharded parameters in their storage dtype (fp32 under a bf16
`MixedPrecisionPolicy`): compile with `source.dtype: float32`; the plan casts on the sources.
"""

from __future__ import annotations

from typing import Any

import torch

from schemas.chunked_plan import plan_header
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.tensors import BoundTensor, rank_tensors

from . import Binding, ModelMismatchError, match

DIMS = ("dp_replicate", "dp_shard", "tp")


def identity(model: torch.nn.Module | None = None, mesh: Any = None) -> dict[str, int | str]:
    """This rank's `(dp_replicate, dp_shard, tp)` coordinates, from `mesh` or the model's
    DTensor parameters (they must agree with one another)."""
    coords: dict[str, int] = {}
    meshes = [mesh] if mesh is not None else [
        p.device_mesh for p in (model.parameters() if model is not None else ())
        if hasattr(p, "device_mesh")]
    seen = set()
    for m in meshes:
        if id(m) in seen:
            continue
        seen.add(id(m))
        names = m.mesh_dim_names or (("dp_shard",) if m.ndim == 1 else None)
        if names is None or any(n not in DIMS for n in names):
            raise ModelMismatchError(f"DeviceMesh dims {m.mesh_dim_names!r}: name them from "
                                     f"{DIMS} (torchtitan's order) so the plan rank is known")
        for n, c in zip(names, m.get_coordinate() or ()):
            if coords.setdefault(n, int(c)) != int(c):
                raise ModelMismatchError(f"DeviceMesh dim {n}: this rank is {coords[n]} in one "
                                         f"parameter's mesh and {c} in another's")
    return {"framework": "fsdp2", **{d: coords.get(d, 0) for d in DIMS}}


def bind(plan_path: str, model: torch.nn.Module, mesh: Any = None) -> Binding:
    """Plan rank, identity and the `to_local()` shards this FSDP2 rank binds."""
    ident = identity(model, mesh)
    header = plan_header(plan_path)
    rank = find_rank(header, ident, plan_path)
    expected = rank_tensors(plan_path, rank)
    live, buffers, problems = {}, set(), []
    want = {t.name: t for t in expected.tensors}
    for name, p in model.named_parameters():
        live[name] = _local(name, p, want.get(name), problems)
    for name, b in model.named_buffers():
        live[name] = b
        buffers.add(name)
    if problems:
        raise ModelMismatchError(f"{plan_path}: plan rank {rank}: {len(problems)} shard(s) "
                                 f"break FSDP2's torch.chunk rule or the plan's boxes: "
                                 f"{'; '.join(problems[:8])}; compile the plan for this mesh")
    tensors = match(expected, live, plan_path, ignore_extra=lambda n: n in buffers)

    def again(h: PlanHeader, path: str) -> tuple[int, dict[str, int | str]]:
        now = identity(model, mesh)  # the parameters' meshes, read again
        return int(find_rank(h, now, path)), now
    return Binding(rank=rank, identity=ident, tensors=tensors, live=again)


def _local(name: str, p: torch.Tensor, planned: BoundTensor | None,
           problems: list[str]) -> torch.Tensor:
    """`p.to_local()` (a DTensor) or `p`, after checking its shard against the chunk rule
    and, for a one-box tensor, against the plan's box."""
    if not hasattr(p, "to_local"):
        return p.data
    local = p.to_local()
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch renamed it: the shape checks in `match` remain
        return local
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(local.shape) != tuple(shape):
        problems.append(f"{name}: local shape {tuple(local.shape)}, torch.chunk gives "
                        f"{tuple(shape)}")
    if planned is not None and len(planned.pieces) == 1 and planned.pieces[0].tensor == name:
        piece = planned.pieces[0]
        if tuple(piece.offsets) != tuple(offset) and all(shape):
            problems.append(f"{name}: this shard starts at {tuple(offset)} of the full tensor, "
                            f"the plan's at {piece.offsets}")
    return local
