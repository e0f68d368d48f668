"""vLLM 0.33's gpt-oss (`GptOssForCausalLM`, the unquantized loader `_load_weights_other`),
read from its source and checked against the real model on CPU (tests/oracles).

Per engine rank, besides the usual `qkv_proj` (with biases) and vocab rows:
- names: attention under `attn.` (checkpoint `self_attn.`), `model.embedding` (checkpoint
  `model.embed_tokens`), `mlp.router.weight/bias` replicated, `attn.o_proj.bias` whole on
  every rank, `attn.sinks` split by head like the query heads.
- experts (`mlp.experts.routed_experts.`): the checkpoint's fused `gate_up_proj [E, H, 2I]`
  (gate and up interleaved by column) is cut on its last dim at `[2s, 2s+2k)` (MoE TP rank
  with `k = I/tp`, `s = rank*k`; interleaving kept) and transposed: `w13_weight [E_loc, 2k,
  H]` (one transposed piece per expert: the logical tensor is the 2-d view `[E*H, 2I]`);
  `gate_up_proj_bias` the same columns: `w13_bias [E_loc, 2k]`; `down_proj [E, I, H]`
  rows `[s, s+k)` transposed: `w2_weight [E_loc, H, k]`; `w2_bias [E_loc, H]` is loaded on
  MoE TP rank 0 only (the others hold zeros: no piece). With EP the loader takes an even
  split `E/ep` of the experts (not the linear placement with a remainder), MoE TP 1.
"""

from __future__ import annotations

from collections.abc import Iterator

from planner.layouts.base import PhysicalTensor, Piece
from planner.layouts.rules import divisors
from planner.layouts.vllm_rank import RankBuilder
from planner.spec import ModelSpec
from schemas.config import TargetConfig, fail

TRANSPOSED = (2, 1)
"""One expert's logical `[a, b]` rows land as physical `[., b, a]`."""


def check(spec: ModelSpec, cfg: TargetConfig) -> None:
    ep = cfg.dp * cfg.tp
    if cfg.ep and spec.dims.num_experts % ep:
        fail("target.ep", cfg.ep, f"splits gpt-oss's {spec.dims.num_experts} experts evenly "
             f"over target.dp*target.tp = {ep} ranks (vLLM's gpt-oss loader); use dp*tp "
             f"among {divisors(spec.dims.num_experts)}")


class GptOssBuilder(RankBuilder):
    def attention(self, i: int) -> Iterator[PhysicalTensor]:
        p, phys, a = f"model.layers.{i}.self_attn.", f"model.layers.{i}.attn.", self.s.attn
        per = self.d.heads // a.size
        yield self.rows(phys + "sinks", [(p + "sinks", a.rank * per, per)])
        yield from self.gqa(p, phys)
        yield self.whole(phys + "o_proj.bias", p + "o_proj.bias")

    def experts(self, p: str) -> Iterator[PhysicalTensor]:
        d, m, dt = self.d, self.s.moe_tp, self.cfg.dtype
        n = d.num_experts // self.s.ep.size
        e0, k, h = self.s.ep.rank * n, d.moe_intermediate // m.size, d.hidden
        s = m.rank * k
        x, out = p + "mlp.experts.", p + "mlp." + self.names.experts
        local = range(e0, e0 + n)  # per expert: logical [E*H, 2I] rows of expert e
        yield PhysicalTensor(out + "w13_weight", (n, 2 * k, h), dt, tuple(
            Piece(x + "gate_up_proj", (e * h, 2 * s), (h, 2 * k), (j, 0, 0), TRANSPOSED)
            for j, e in enumerate(local)))
        yield PhysicalTensor(out + "w13_bias", (n, 2 * k), dt, (Piece(
            x + "gate_up_proj_bias", (e0, 2 * s), (n, 2 * k), (0, 0)),))
        inter = d.moe_intermediate
        yield PhysicalTensor(out + "w2_weight", (n, h, k), dt, tuple(
            Piece(x + "down_proj", (e * inter + s, 0), (k, h), (j, 0, 0), TRANSPOSED)
            for j, e in enumerate(local)))
        bias = (Piece(x + "down_proj_bias", (e0, 0), (n, h), (0, 0)),) if m.rank == 0 else ()
        yield PhysicalTensor(out + "w2_bias", (n, h), dt, bias)

    def layer(self, i: int) -> Iterator[PhysicalTensor]:
        p = f"model.layers.{i}."
        yield from self.attention(i)
        yield self.whole(p + "mlp.router.weight")
        yield self.whole(p + "mlp.router.bias")
        yield from self.experts(p)
        yield self.whole(p + "input_layernorm.weight")
        yield self.whole(p + "post_attention_layernorm.weight")

    def tensors(self) -> Iterator[PhysicalTensor]:
        if self.s.embed:
            yield self.vocab("model.embedding.weight", "model.embed_tokens.weight",
                             self.s.embed_vocab or self.s.vocab)
        for i in self.s.layers:
            yield from self.layer(i)
        if self.s.head:
            yield self.whole("model.norm.weight")
            yield self.vocab("lm_head.weight", "lm_head.weight", self.s.vocab)
