"""FSDP2 (torch 2.13 `fully_shard`) source layout, with optional TP (FSDP2+TP) and HSDP.

Names and full shapes are the HF model's `named_parameters()` (MTP layers excluded: they
are not in the HF model; a tied `lm_head` is not listed). Each parameter is a DTensor
`Shard(0)` on its own dim 0 over the `dp` shard ranks, with the `torch.chunk` rule
(chunk `c = ceil(d0/dp)`, rank d holds rows `[d*c, min((d+1)*c, d0))`; trailing ranks may
hold an empty `(0, ...)` tensor). Buffers (`e_score_correction_bias`) are not sharded:
every rank holds them whole, in their logical dtype.

FSDP2+TP: the local tensor is `full.chunk(tp, tp_dim)[t].chunk(dp, 0)[d]` (FSDP2 shards
the TP-local tensor on dim 0; `_StridedShard` when tp_dim is 0). The TP plan follows
torchtitan's: colwise (dim 0) for q/k/v (and their biases), q_proj/q_b_proj/kv_b_proj
(MLA), gate/up (dense, shared and per-expert), `lm_head`; rowwise (dim 1) for o_proj and
down_proj; `embed_tokens` split on the vocab (dim 0, torchtitan's RowwiseParallel of an
embedding); norms, the router `gate`, MLA `q_a_proj`/`kv_a_proj_with_mqa` replicated.
Fused experts with tp > 1 are refused (a colwise cut of `gate_up_proj` mixes gate and up).

Rank order: `rank = tp_rank + tp * (dp_rank + dp * replicate_rank)` (TP fastest; the
DeviceMesh `("dp_replicate", "dp_shard", "tp")`, as torchtitan builds it).

Order within a layer (transformers' module order): `self_attn.*`, `mlp.*`,
`input_layernorm`, `post_attention_layernorm`. MoE blocks: fused (transformers 5.x)
`experts.gate_up_proj`, `experts.down_proj`, `gate`, `shared_experts`; checkpoint-named
experts (transformers 4.57): qwen3_moe `gate` then `experts.{e}`, deepseek_v3
`experts.{e}`, `gate`, `shared_experts`.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from planner.layouts import rules
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.layouts.shards import chunk, whole
from planner.spec import LogicalTensor, ModelDims, ModelSpec
from schemas.config import SourceConfig, fail

_COLWISE = re.compile(r"\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|w1|w3)\.")
_ROWWISE = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")


@dataclass(frozen=True, slots=True)
class _Param:
    """One unsharded parameter (or buffer) of the HF model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    tp_dim: int | None
    buffer: bool = False
    starts: tuple[int, ...] = field(init=False)
    """`at[0]` of each piece (pieces are sorted by it), to find a shard's pieces quickly."""
    reach: int = field(init=False)
    """The largest extent of a piece along dim 0."""
    plain: bool = field(init=False)
    """One piece, the whole tensor (a shard is then one box)."""
    spans: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = \
        field(init=False)
    """(at, at + physical sizes, physical dims) of each piece, for `restrict`."""

    def __post_init__(self) -> None:
        pieces = tuple(sorted(self.pieces, key=lambda p: p.at[0]))
        object.__setattr__(self, "pieces", pieces)
        object.__setattr__(self, "starts", tuple(p.at[0] for p in pieces))
        object.__setattr__(self, "reach", max((p.phys_sizes()[0] for p in pieces), default=0))
        object.__setattr__(self, "plain", len(pieces) == 1 and pieces[0].sizes == self.shape)
        object.__setattr__(self, "spans", tuple(
            (p.at, tuple(a + s for a, s in zip(p.at, p.phys_sizes())), p.phys_dims())
            for p in pieces))


def tp_dim(name: str) -> int | None:
    """The dim TP cuts (torchtitan's plan), or None for a replicated parameter."""
    if name in ("model.embed_tokens.weight", "lm_head.weight") or _COLWISE.search(name):
        return 0
    if _ROWWISE.search(name):
        return 1
    return None


def check(spec: ModelSpec, cfg: SourceConfig) -> None:
    """FSDP2 shards any shape (`torch.chunk`, uneven allowed); FSDP2+TP needs whole query
    and KV heads on each TP rank, and experts named as in checkpoints."""
    d, tp = spec.dims, cfg.tp
    if tp == 1:
        return
    rules.divides("source.tp", tp, d.heads, "num_attention_heads")
    if not d.mla and d.kv_heads % tp:
        fail("source.tp", tp, f"must divide num_key_value_heads={d.kv_heads} (FSDP2+TP "
                   "cuts k_proj/v_proj by rows, no KV-head replication); use one of "
                   f"{rules.divisors(d.kv_heads)}")
    if d.model_type == "gpt_oss":
        fail("source.tp", tp, "has no TP plan for gpt-oss's fused experts (gate and up "
                   "interleaved in gate_up_proj); use source.tp: 1")
    if cfg.fused_experts and d.moe_layers:
        fail("source.fused_experts", True, f"cannot be combined with source.tp={tp} (a "
                   "colwise cut of gate_up_proj mixes gate and up); use tp 1 or "
                   "checkpoint-named experts")


def layout(spec: ModelSpec, cfg: SourceConfig) -> Layout:
    """Every FSDP2 rank's local shards as pieces."""
    check(spec, cfg)
    params = hf_params(spec, cfg)
    tp, dp = cfg.tp, cfg.dp
    cols = [[_locals(p, cfg, t) for p in params] for t in range(tp)]  # [t][param][d]
    shards = {(t, d): tuple(col[d] for col in cols[t]) for t in range(tp) for d in range(dp)}
    ranks = tuple(RankLayout(rank=rank, replica=rank // (tp * dp),
                             tensors=shards[rank % tp, (rank // tp) % dp])
                  for rank in range(cfg.world))
    return Layout(side="source", framework="fsdp2", ranks=ranks, replicas=cfg.dp_replicate)


def hf_params(spec: ModelSpec, cfg: SourceConfig) -> list[_Param]:
    """The HF model's parameters in `named_parameters()` order, then its trained buffers."""
    d = spec.dims
    out: list[_Param] = []
    layer: list[LogicalTensor] = []
    for t in spec.tensors:
        if t.mtp:
            continue
        if t.layer < 0:
            out += _layer_params(d, layer, cfg)
            layer = []
            out.append(_plain(t, cfg))
        else:
            if layer and layer[0].layer != t.layer:
                out += _layer_params(d, layer, cfg)
                layer = []
            layer.append(t)
    out += _layer_params(d, layer, cfg)
    return [p for p in out if not p.buffer] + [p for p in out if p.buffer]


def _plain(t: LogicalTensor, cfg: SourceConfig) -> _Param:
    if t.stored:  # a 3-d checkpoint tensor (gpt-oss experts), logical 2-d view: by expert
        rows = t.shape[0] // t.stored[0]
        pieces = tuple(Piece(t.name, (x * rows, 0), (rows, t.shape[1]), (x, 0, 0))
                       for x in range(t.stored[0]))
        return _Param(t.name, t.stored, cfg.dtype, pieces, None)
    return _Param(t.name, t.shape, t.dtype if t.buffer else cfg.dtype,
                  (whole(t.name, t.shape),), None if t.buffer else tp_dim(t.name), t.buffer)


def _layer_params(d: ModelDims, tensors: Sequence[LogicalTensor],
                  cfg: SourceConfig) -> list[_Param]:
    if not tensors:
        return []
    fused = cfg.fused_experts and d.is_moe(tensors[0].layer)
    moe = f".{d.moe_module}."
    gate_first = d.model_type == "mixtral" or (d.model_type == "qwen3_moe" and not fused)

    def rank(t: LogicalTensor) -> int:
        n = t.name
        if ".self_attn." in n:
            return 0
        if moe + "experts." in n:
            return 2 if gate_first else 1
        if moe + "gate." in n:
            return 1 if gate_first else 2
        if ".mlp.shared_experts." in n:
            return 3
        if ".mlp." in n:
            return 1
        return 4 if "input_layernorm" in n else 5

    ordered = sorted(tensors, key=rank)  # stable: keeps the checkpoint order inside a group
    names = "|".join(d.expert_names)
    out: list[_Param] = []
    for t in ordered:
        m = re.search(rf"{re.escape(moe)}experts\.(\d+)\.({names})\.weight$", t.name)
        if fused and m:
            if m.group(1) == "0" and m.group(2) != d.expert_names[1]:
                out.append(_fused(d, t.name[: m.start()], m.group(2) == d.expert_names[2],
                                  cfg.dtype))
            continue
        if fused and moe != ".mlp." and moe + "gate." in t.name:  # transformers 5.x renames
            out.append(replace(_plain(t, cfg), name=t.name.replace(moe, ".mlp.")))
            continue
        out.append(_plain(t, cfg))
    return out


def _fused(d: ModelDims, layer: str, down: bool, dtype: str) -> _Param:
    """transformers 5.x `mlp.experts.gate_up_proj [E, 2I, H]` (`[gate; up]` per expert) or
    `mlp.experts.down_proj [E, H, I]` of the layer prefix `layer` (`model.layers.N`)."""
    e, i, h = d.num_experts, d.moe_intermediate, d.hidden
    logical = f"{layer}.{d.moe_module}.experts."
    gate, up, down_name = d.expert_names
    prefix = layer + ".mlp.experts."
    if not down:
        pieces = [Piece(f"{logical}{x}.{w}.weight", (0, 0), (i, h), (x, k * i, 0))
                  for x in range(e) for k, w in enumerate((gate, up))]
        return _Param(prefix + "gate_up_proj", (e, 2 * i, h), dtype, tuple(pieces), None)
    pieces = [Piece(f"{logical}{x}.{down_name}.weight", (0, 0), (h, i), (x, 0, 0))
              for x in range(e)]
    return _Param(prefix + "down_proj", (e, h, i), dtype, tuple(pieces), None)


def _locals(p: _Param, cfg: SourceConfig, t: int) -> list[PhysicalTensor]:
    """`_local` of TP rank t and every FSDP rank d (a buffer's one tensor for all; a plain
    parameter's boxes made in one go)."""
    if p.buffer:
        return [_local(p, cfg, t, 0)] * cfg.dp
    if not p.plain:
        return [_local(p, cfg, t, d) for d in range(cfg.dp)]
    lo, hi = [0] * len(p.shape), list(p.shape)
    if cfg.tp > 1 and p.tp_dim is not None:
        lo[p.tp_dim], hi[p.tp_dim] = chunk(p.shape[p.tp_dim], cfg.tp, t)
    n, first = hi[0] - lo[0], lo[0]
    c = -(-n // cfg.dp)
    rest_lo, rest = tuple(lo[1:]), tuple(y - x for x, y in zip(lo[1:], hi[1:]))
    at, name, tensor, dtype = (0,) * len(p.shape), p.name, p.pieces[0].tensor, p.dtype
    out = []
    for d in range(cfg.dp):
        a = min(d * c, n)
        shape = (min(a + c, n) - a, *rest)
        pieces = (Piece(tensor, (first + a, *rest_lo), shape, at),) if all(shape) else ()
        out.append(PhysicalTensor(name, shape, dtype, pieces))
    return out


def _local(p: _Param, cfg: SourceConfig, t: int, d: int) -> PhysicalTensor:
    """The shard of TP rank t, FSDP rank d: `full.chunk(tp, tp_dim)[t].chunk(dp, 0)[d]`."""
    if p.buffer:
        return PhysicalTensor(p.name, p.shape, p.dtype, p.pieces, buffer=True)
    lo, hi = [0] * len(p.shape), list(p.shape)
    if cfg.tp > 1 and p.tp_dim is not None:
        lo[p.tp_dim], hi[p.tp_dim] = chunk(p.shape[p.tp_dim], cfg.tp, t)
    n = hi[0] - lo[0]
    c = -(-n // cfg.dp)  # `chunk`, inline: this runs for every parameter of every rank
    a = min(d * c, n)
    lo[0], hi[0] = lo[0] + a, lo[0] + min(a + c, n)
    shape = tuple(y - x for x, y in zip(lo, hi))
    if p.plain:  # a plain parameter: one box
        piece = Piece(p.pieces[0].tensor, tuple(lo), shape, (0,) * len(shape))
        return PhysicalTensor(p.name, shape, p.dtype, (piece,) if all(shape) else ())
    first, stop = bisect_left(p.starts, lo[0] - p.reach + 1), bisect_left(p.starts, hi[0])
    return PhysicalTensor(p.name, shape, p.dtype,
                          _restrict(p.pieces[first:stop], p.spans[first:stop], lo, hi))


def identity(cfg: SourceConfig, rank: int) -> dict[str, int | str]:
    """Rank `rank`'s DeviceMesh coordinates (`schemas/identity.py`), TP fastest."""
    tp, dp = cfg.tp, cfg.dp
    return {"framework": "fsdp2", "dp_replicate": rank // (tp * dp),
            "dp_shard": (rank // tp) % dp, "tp": rank % tp}


def replicated(cfg: SourceConfig) -> bool:
    """Whether every rank holds the whole model: no TP and no sharding (`dp` 1; any number
    of replicas)."""
    return cfg.tp * cfg.dp == 1


def restrict(pieces: Sequence[Piece], lo: Sequence[int], hi: Sequence[int]
             ) -> tuple[Piece, ...]:
    """The parts of `pieces` inside the physical region `[lo, hi)`, re-based to `lo`."""
    spans = [(p.at, tuple(a + s for a, s in zip(p.at, p.phys_sizes())), p.phys_dims())
             for p in pieces]
    return _restrict(pieces, spans, lo, hi)


def _restrict(pieces: Sequence[Piece], spans: Sequence[tuple[tuple[int, ...], ...]],
              lo: Sequence[int], hi: Sequence[int]) -> tuple[Piece, ...]:
    """`restrict`, given each piece's (at, stop, dims) (`_Param.spans`)."""
    out = []
    for piece, (start, stop, dims) in zip(pieces, spans):
        new_lo = [max(a, x) for a, x in zip(start, lo)]
        new_hi = [min(b, y) for b, y in zip(stop, hi)]
        if any(x >= y for x, y in zip(new_lo, new_hi)):
            continue
        offsets = tuple(o + new_lo[pd] - start[pd] for o, pd in zip(piece.offsets, dims))
        sizes = tuple(new_hi[pd] - new_lo[pd] for pd in dims)
        at = tuple(x - y for x, y in zip(new_lo, lo))
        out.append(Piece(piece.tensor, offsets, sizes, at, piece.dims))
    return tuple(out)
