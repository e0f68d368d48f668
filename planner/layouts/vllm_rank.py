"""The tensors of one vLLM (or SGLang) engine rank: how the rank cuts each family of tensors
(`Shard`, `Split`), the engine's native names (`Names`), and `RankBuilder`, which lists the
rank's physical tensors as pieces of the logical ones (`planner/layouts/vllm.py` documents
the cut)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.layouts.base import PhysicalTensor, Piece, PieceColumns
from planner.models.base import ModelDims
from planner.spec import LogicalTensor, ModelSpec
from schemas.config import TargetConfig
from schemas.placement import Placement

VOCAB_PAD = 64
"""vLLM and SGLang pad the vocab of `embed_tokens`/`lm_head` to a multiple of this."""


@dataclass(frozen=True, slots=True)
class Split:
    """One parallel split: `size` ranks, this rank is `rank`."""

    size: int = 1
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Shard:
    """How one engine rank cuts each family of tensors."""

    attn: Split
    """Attention heads (qkv, o_proj, MLA q_b/kv_b)."""
    mlp: Split
    """Dense MLP and shared experts."""
    vocab: Split
    """lm_head rows (and embed_tokens rows unless `embed_vocab` is given)."""
    moe_tp: Split
    """Each routed expert's intermediate dim."""
    ep: Split
    """Expert parallel: which experts this rank holds."""
    layers: range
    """Global decoder layers of this PP stage."""
    embed: bool
    """Holds `embed_tokens`."""
    head: bool
    """Holds `model.norm` and `lm_head`."""
    embed_vocab: Split | None = None
    """embed_tokens rows when they differ from lm_head's (size 1: replicated)."""
    shared: Split | None = None
    """Shared experts when they differ from `mlp` (size 1: replicated)."""


@dataclass(frozen=True, slots=True)
class Names:
    """Engine-specific native names."""

    experts: str = "experts.routed_experts."
    """Prefix of w13_weight/w2_weight inside the MoE block (`ModelDims.moe_module`)."""
    fused_qkv_a: str = "fused_qkv_a_proj"
    """MLA's fused [q_a_proj; kv_a_proj_with_mqa]."""


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PAD) * VOCAB_PAD


def expert_range(num_experts: int, ep: Split) -> range:
    """vLLM "linear" placement: `base + (r < rem)` experts from `r*base + min(r, rem)`."""
    base, rem = divmod(num_experts, ep.size)
    start = ep.rank * base + min(ep.rank, rem)
    return range(start, start + base + (ep.rank < rem))



@lru_cache(maxsize=1024)
def _expert_names(prefix: str, local: range | tuple[int, ...],
                  weights: tuple[str, ...]) -> tuple[str, ...]:
    """`{prefix}{e}.{w}` for each expert e of `local`, each weight w: one tuple shared by
    every rank holding those experts (the piece table looks its names up once)."""
    return tuple(f"{prefix}{e}.{w}" for e in local for w in weights)


def eplb_layers(d: ModelDims) -> tuple[int, ...]:
    """The MoE layers an expert placement has a row for, in order: the decoder's (an MTP
    layer is not loaded by the engine and has no row in its EPLB maps)."""
    return tuple(i for i in d.moe_layers if i < d.num_layers)


def local_experts(spec_layers: tuple[int, ...], layer: int, num_experts: int, ep: Split,
                  placement: Placement | None) -> range | tuple[int, ...]:
    """The logical expert of each local physical slot of MoE layer `layer` on EP rank
    `ep.rank`: with an expert placement (EPLB) row `moe index` of its table over the rank's
    even share of slots (redundant replicas included), else vLLM's "linear" placement."""
    if placement is None:
        return expert_range(num_experts, ep)
    row = placement.table[spec_layers.index(layer)]
    return tuple(row[placement.slots(ep.size, ep.rank)].tolist())


class RankBuilder:
    """Builds one rank's physical tensors; `lt` looks logical tensors up by name."""

    def __init__(self, spec: ModelSpec, cfg: TargetConfig, s: Shard, names: Names):
        self.d, self.cfg, self.s, self.names = spec.dims, cfg, s, names
        self.lt = spec.by_name

    def dtype(self, t: LogicalTensor) -> str:
        return "float32" if t.buffer else self.cfg.dtype

    def whole(self, name: str, logical: str | None = None) -> PhysicalTensor:
        t = self.lt[logical or name]
        return PhysicalTensor(name, t.shape, self.dtype(t),
                              (Piece(t.name, (0,) * len(t.shape), t.shape, (0,) * len(t.shape)),))

    def rows(self, name: str, parts: list[tuple[str, int, int]], cols: int | None = None,
             shape0: int | None = None) -> PhysicalTensor:
        """Row-stacked pieces `(logical, first row, rows)`; 1-D tensors when cols is None."""
        pieces, at = [], 0
        for logical, start, n in parts:
            if n == 0:  # a rank of vocab padding only
                continue
            if cols is None:
                pieces.append(Piece(logical, (start,), (n,), (at,)))
            else:
                pieces.append(Piece(logical, (start, 0), (n, cols), (at, 0)))
            at += n
        shape = (shape0 if shape0 is not None else at,) + (() if cols is None else (cols,))
        return PhysicalTensor(name, shape, self.dtype(self.lt[parts[0][0]]), tuple(pieces))

    def column_split(self, name: str, logical: str, split: Split) -> PhysicalTensor:
        """Row-parallel weight: columns `[r*n/size, (r+1)*n/size)`."""
        out, n = self.lt[logical].shape
        k = n // split.size
        return PhysicalTensor(name, (out, k), self.dtype(self.lt[logical]),
                              (Piece(logical, (0, split.rank * k), (out, k), (0, 0)),))

    def row_split(self, name: str, logical: str, split: Split) -> PhysicalTensor:
        """Column-parallel weight: rows `[r*n/size, (r+1)*n/size)`."""
        n, cols = self.lt[logical].shape
        k = n // split.size
        return self.rows(name, [(logical, split.rank * k, k)], cols)

    def vocab(self, name: str, logical: str, split: Split) -> PhysicalTensor:
        v, h = self.lt[logical].shape
        per = padded_vocab(v) // split.size
        start = split.rank * per
        n = max(0, min(start + per, v) - start)
        return self.rows(name, [(logical, start, n)], h, shape0=per)

    def gated(self, p: str, lp: str, split: Split) -> Iterator[PhysicalTensor]:
        """`gate_up_proj` [gate; up] and `down_proj` of a dense MLP or shared experts."""
        inter, h = self.lt[lp + "gate_proj.weight"].shape
        k = inter // split.size
        yield self.rows(p + "gate_up_proj.weight", [(lp + "gate_proj.weight", split.rank * k, k),
                                                    (lp + "up_proj.weight", split.rank * k, k)], h)
        yield self.column_split(p + "down_proj.weight", lp + "down_proj.weight", split)

    def gqa(self, p: str, phys: str | None = None) -> Iterator[PhysicalTensor]:
        """qkv_proj, o_proj (and q/k norms) of the attention with logical prefix `p`, named
        `phys` on the engine (default: `p`)."""
        d, a, phys = self.d, self.s.attn, phys or p
        hd, q = d.head_dim, d.heads // a.size
        if a.size >= d.kv_heads:
            kv0, nkv = a.rank // (a.size // d.kv_heads), 1
        else:
            nkv = d.kv_heads // a.size
            kv0 = a.rank * nkv
        suffixes = ("weight", "bias") if d.qkv_bias else ("weight",)
        for sfx in suffixes:
            parts = [(f"{p}q_proj.{sfx}", a.rank * q * hd, q * hd),
                     (f"{p}k_proj.{sfx}", kv0 * hd, nkv * hd),
                     (f"{p}v_proj.{sfx}", kv0 * hd, nkv * hd)]
            yield self.rows(f"{phys}qkv_proj.{sfx}", parts,
                            d.hidden if sfx == "weight" else None)
        yield self.column_split(phys + "o_proj.weight", p + "o_proj.weight", a)
        if d.qk_norm:
            yield self.whole(phys + "q_norm.weight", p + "q_norm.weight")
            yield self.whole(phys + "k_norm.weight", p + "k_norm.weight")

    def mla(self, p: str) -> Iterator[PhysicalTensor]:
        d, a = self.d, self.s.attn
        if d.q_lora_rank:
            yield self.rows(f"{p}{self.names.fused_qkv_a}.weight",
                            [(p + "q_a_proj.weight", 0, d.q_lora_rank),
                             (p + "kv_a_proj_with_mqa.weight", 0,
                              d.kv_lora_rank + d.qk_rope_head_dim)], d.hidden)
            yield self.whole(p + "q_a_layernorm.weight")
            yield self.row_split(p + "q_b_proj.weight", p + "q_b_proj.weight", a)
        else:
            yield self.whole(p + "kv_a_proj_with_mqa.weight")
            yield self.row_split(p + "q_proj.weight", p + "q_proj.weight", a)
        yield self.whole(p + "kv_a_layernorm.weight")
        yield self.row_split(p + "kv_b_proj.weight", p + "kv_b_proj.weight", a)
        yield self.column_split(p + "o_proj.weight", p + "o_proj.weight", a)

    def experts(self, p: str) -> Iterator[PhysicalTensor]:
        """Stacked routed experts of layer prefix `p`, as columns (`PieceColumns`)."""
        d, m = self.d, self.s.moe_tp
        k, h = d.moe_intermediate // m.size, d.hidden
        layer = int(p.split(".")[2])
        local = local_experts(eplb_layers(d), layer, d.num_experts, self.s.ep,
                              self.cfg.placement)
        n = len(local)
        gate, up = (0, k) if self.cfg.w13_order == "w1w3" else (k, 0)  # w3w1: FlashInfer
        g, u, dn = (f"{name}.weight" for name in d.expert_names)
        j = np.arange(n)
        w13_at = np.zeros((n, 2, 3), dtype=np.int64)  # expert j: its gate, then its up
        w13_at[:, :, 0] = j[:, None]
        w13_at[:, :, 1] = (gate, up)
        w13 = PieceColumns(_expert_names(f"{p}{d.moe_module}.experts.", local, (g, u)),
                           np.broadcast_to([m.rank * k, 0], (2 * n, 2)),
                           np.broadcast_to([k, h], (2 * n, 2)), w13_at.reshape(2 * n, 3))
        w2_at = np.zeros((n, 3), dtype=np.int64)
        w2_at[:, 0] = j
        w2 = PieceColumns(_expert_names(f"{p}{d.moe_module}.experts.", local, (dn,)),
                          np.broadcast_to([0, m.rank * k], (n, 2)),
                          np.broadcast_to([h, k], (n, 2)), w2_at)
        ep = f"{p}{d.moe_module}.{self.names.experts}"
        yield PhysicalTensor(ep + "w13_weight", (n, 2 * k, h), self.cfg.dtype, w13)
        yield PhysicalTensor(ep + "w2_weight", (n, h, k), self.cfg.dtype, w2)

    def layer(self, i: int) -> Iterator[PhysicalTensor]:
        p = f"model.layers.{i}."
        yield from self.mla(p + "self_attn.") if self.d.mla else self.gqa(p + "self_attn.")
        if self.d.is_moe(i):
            moe = f"{p}{self.d.moe_module}."
            yield self.whole(moe + "gate.weight")
            bias = moe + "gate.e_score_correction_bias"
            if bias in self.lt:
                yield self.whole(bias)
            if self.d.shared_intermediate:
                yield from self.gated(p + "mlp.shared_experts.", p + "mlp.shared_experts.",
                                      self.s.shared or self.s.mlp)
            yield from self.experts(p)
        else:
            yield from self.gated(p + "mlp.", p + "mlp.", self.s.mlp)
        yield self.whole(p + "input_layernorm.weight")
        yield self.whole(p + "post_attention_layernorm.weight")

    def tensors(self) -> Iterator[PhysicalTensor]:
        if self.s.embed:
            yield self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight",
                             self.s.embed_vocab or self.s.vocab)
        for i in self.s.layers:
            yield from self.layer(i)
        if self.s.head:
            yield self.whole("model.norm.weight")
            if not self.d.tied:
                yield self.vocab("lm_head.weight", "lm_head.weight", self.s.vocab)
            elif not self.s.embed:  # tied, last PP stage without the embedding (SGLang)
                yield self.vocab("lm_head.weight", "model.embed_tokens.weight", self.s.vocab)
