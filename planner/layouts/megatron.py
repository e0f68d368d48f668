"""Megatron-Core (0.16.1) source layout: TP, PP, EP/ETP and DP shards of a GPTModel.

Rank grid (`parallel_state.initialize_model_parallel`, order `tp-cp-ep-dp-pp`, cp = 1):
dense weights  `rank = tp_rank + tp * (dp_rank + dp * pp_rank)` (TP fastest);
expert weights `rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))` with
`edp = tp * dp / (etp * ep)`. Both grids share the PP stage of a rank.

Names are what `GPTModel.named_parameters()` gives on a rank, in that order (module
registration order: `input_layernorm`, `self_attention.linear_proj` before `linear_qkv`,
`pre_mlp_layernorm`, `mlp`; in a MoE layer `router`, `experts`, `shared_experts`), then
the trained buffers (`mlp.router.expert_bias`). Layer indices are local to the PP stage.
With `transformer_engine`, the norms fuse into the next linear as `layer_norm_weight`
(placed before that linear's `weight`, as TE registers it); MoE layers keep
`pre_mlp_layernorm`; MLA keeps `input_layernorm` and replicates its down projections.

Virtual pipeline (`source.vpp` > 1, the interleaved schedule): a rank holds `vpp` model
chunks; chunk v of stage p holds the layers `chunk_layers` gives, with indices local to the
chunk, and its names start with `model{v}.` (Megatron-LM's checkpoint keys for chunks).
The embedding is in chunk 0 of stage 0, the final norm and output layer in the last chunk
of the last stage. Checked against real Megatron-Core chunks (tests/oracles, VPP oracle:
names, shapes, each chunk's `layer_number`s and the logits, uneven first stage included).

DeepSeek MTP layers are left out (Megatron builds them in a separate `mtp` block).

Checked against the real GPTModel (local spec) on CPU: names, shapes and forward logits
for dense/MoE Qwen3 (TP 4 with ng 2, PP 2 tied, EP, ETP), names and shapes for MLA with
shared experts (tests/oracles). The Transformer Engine names (`layer_norm_weight`
registered before `weight` by TE's LayerNormLinear; grouped `weight{i}` of
TEGroupedLinear) are read from the sources, not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from planner.layouts import rules
from planner.layouts.base import Layout, PhysicalTensor, RankLayout
from planner.layouts.shards import box, cut_rows, even, physical, whole
from planner.spec import LogicalTensor, ModelDims, ModelSpec
from schemas.config import ConfigError, SourceConfig, fail

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe")
"""The model_types these rules cover (others: specs from transformers, no rules)."""


@dataclass(frozen=True, slots=True)
class _Coords:
    tp: int
    pp: int
    etp: int
    ep: int


def stage_layers(num_layers: int, cfg: SourceConfig) -> list[range]:
    """Global layer indices of each PP stage (Megatron's `get_num_layers_to_build`)."""
    pp, first, last = cfg.pp, cfg.pp_first_stage_layers, cfg.pp_last_stage_layers
    if pp > num_layers:
        raise ConfigError(f"source.pp: {pp} is more than the model's {num_layers} layers; "
                          f"use at most {num_layers} stages")
    counts: list[int | None] = [None] * pp
    if first is not None or last is not None:
        if pp < 2:
            key = "source.pp_first_stage_layers" if first is not None else \
                "source.pp_last_stage_layers"
            raise ConfigError(f"{key}: {first if first is not None else last} needs "
                              f"source.pp >= 2 (got pp={pp}); remove it or raise pp")
        counts[0], counts[-1] = first, last
    rest = num_layers - sum(c for c in counts if c is not None)
    left = sum(c is None for c in counts)
    if first is None and last is None and num_layers % pp:
        raise ConfigError(f"source.pp: {pp} must divide the model's {num_layers} layers; use "
                          f"one of {rules.divisors(num_layers)}, or set "
                          "source.pp_first_stage_layers / pp_last_stage_layers")
    if rest < 0 or (left and (rest % left or rest < left)) or (not left and rest):
        raise ConfigError(
            f"source.pp: {pp} stages cannot split {num_layers} layers (first stage "
            f"{first}, last stage {last}): the remaining {rest} layers must divide evenly "
            f"over the other {left} stages (at least one each); change pp or the first/last "
            "stage layers")
    per = rest // left if left else 0
    out, start = [], 0
    for c in counts:
        n = per if c is None else c
        out.append(range(start, start + n))
        start += n
    return out


def chunk_layers(num_layers: int, cfg: SourceConfig) -> list[list[range]]:
    """Global layer indices of each virtual chunk of each PP stage (`[stage][chunk]`).

    Megatron-Core's interleaved schedule (`get_transformer_layer_offset`): stage p holds
    `n_p` layers (`stage_layers`), `n_p / vpp` in each chunk; chunk v of stage p starts at
    `v * T + sum(n_q / vpp for q < p)` with `T = num_layers / vpp` (one round of chunks over
    the stages). Uneven first/last stages keep their counts, split evenly over the chunks.
    """
    stages = stage_layers(num_layers, cfg)
    vpp = cfg.vpp
    if vpp == 1:
        return [[r] for r in stages]
    if cfg.pp < 2:
        raise ConfigError(f"source.vpp: {vpp} needs source.pp >= 2 (got pp={cfg.pp}); "
                          "remove vpp or raise pp")
    for p, r in enumerate(stages):
        if len(r) % vpp:
            raise ConfigError(f"source.vpp: {vpp} does not divide the {len(r)} layers of PP "
                              f"stage {p}; each stage's layers must split evenly into vpp "
                              "chunks: change vpp, pp or the first/last stage layers")
    per = [len(r) // vpp for r in stages]
    round_ = sum(per)
    return [[range(v * round_ + sum(per[:p]), v * round_ + sum(per[:p]) + per[p])
             for v in range(vpp)] for p in range(cfg.pp)]


def identity(cfg: SourceConfig, rank: int) -> dict[str, int | str]:
    """Rank `rank`'s coordinates (`schemas/identity.py`), from the grid in the docstring."""
    tp, dp, etp, ep = cfg.tp, cfg.dp, cfg.expert_tp, cfg.ep
    s = rank % (tp * dp)  # the rank within its PP stage, on both grids
    return {"framework": "megatron", "tp": rank % tp, "pp": rank // (tp * dp), "vpp": cfg.vpp,
            "dp": s // tp, "ep": (s // etp) % ep, "etp": s % etp, "edp": s // (etp * ep)}


def replicated(cfg: SourceConfig) -> bool:
    """Whether every rank holds the whole model (no TP, PP, EP or expert TP: pure DP)."""
    return cfg.tp * cfg.pp * cfg.ep * cfg.expert_tp == 1


def padded_vocab(vocab: int, cfg: SourceConfig) -> int:
    if cfg.vocab_padding == "none":
        return vocab  # check() requires vocab % tp == 0
    mult = 128 * cfg.tp
    return -(-vocab // mult) * mult


def check(spec: ModelSpec, cfg: SourceConfig) -> None:
    """The combinations Megatron-Core cannot build, as ConfigErrors naming the key."""
    d, tp = spec.dims, cfg.tp
    rules.has_rules("source.framework", cfg.framework, d, FAMILIES)
    rules.attention_tp("source.tp", tp, tp, d)
    qkv_rows = (d.heads + 2 * d.kv_heads) * d.head_dim
    if not d.mla and qkv_rows % tp:
        fail("source.tp", tp, f"must divide linear_qkv's {qkv_rows} rows; use one of "
                   f"{rules.divisors(qkv_rows)}")
    rules.mlp_tp("source.tp", tp, d)
    if cfg.vocab_padding == "none" and d.vocab % tp:
        fail("source.tp", tp, f"must divide vocab_size={d.vocab} when "
                   "source.vocab_padding is none; set source.vocab_padding: megatron")
    if d.mla and not cfg.transformer_engine:
        _check_mla_local_spec(d, tp)
    stage_layers(d.num_layers, cfg)
    ep, etp = cfg.ep, cfg.expert_tp
    if d.moe_layers:  # (a MoE family whose layers are all dense has no experts to place)
        rules.divides("source.ep", ep, d.num_experts, "the number of routed experts")
        rules.divides("source.etp" if cfg.etp is not None else "source.tp", etp,
                      d.moe_intermediate, "moe_intermediate_size")
    if (tp * cfg.dp) % (etp * ep):
        fail("source.ep", ep, f"times expert tp {etp} must divide source.tp * "
                   f"source.dp = {tp * cfg.dp} (Megatron's expert grid etp*ep*edp = tp*dp); "
                   "change source.ep, source.etp or source.dp")


def _check_mla_local_spec(d: ModelDims, tp: int) -> None:
    """The local spec splits the MLA down projections' rows over tp (TE replicates them)."""
    if d.q_lora_rank and d.q_lora_rank % tp:
        fail("source.tp", tp, f"must divide q_lora_rank={d.q_lora_rank} (Megatron's "
                   "local spec splits linear_q_down_proj); set source.transformer_engine: "
                   f"true or use one of {rules.divisors(d.q_lora_rank)}")
    kv_rows = d.kv_lora_rank + d.qk_rope_head_dim
    if kv_rows % tp:
        fail("source.tp", tp, f"must divide kv_lora_rank + qk_rope_head_dim={kv_rows} "
                   "(Megatron's local spec splits linear_kv_down_proj); set "
                   f"source.transformer_engine: true or use one of {rules.divisors(kv_rows)}")


def layout(spec: ModelSpec, cfg: SourceConfig) -> Layout:
    """Every Megatron rank's parameters (and `router.expert_bias` buffers) as pieces."""
    d = spec.dims
    check(spec, cfg)
    chunks = chunk_layers(d.num_layers, cfg)
    vocab = padded_vocab(d.vocab, cfg)
    by_name = spec.by_name
    tp, dp, etp, ep = cfg.tp, cfg.dp, cfg.expert_tp, cfg.ep
    cache: dict[_Coords, tuple[PhysicalTensor, ...]] = {}
    ranks = []
    for rank in range(cfg.world):
        c = _Coords(tp=rank % tp, pp=rank // (tp * dp), etp=rank % etp,
                    ep=(rank // etp) % ep)
        if c not in cache:
            cache[c] = tuple(_rank(_Ctx(d, cfg, by_name, c, vocab), chunks[c.pp]))
        ranks.append(RankLayout(rank=rank, replica=(rank // tp) % dp, tensors=cache[c]))
    return Layout(side="source", framework="megatron", ranks=tuple(ranks), replicas=dp)


@dataclass(frozen=True, slots=True)
class _Ctx:
    d: ModelDims
    cfg: SourceConfig
    by_name: dict[str, LogicalTensor]
    c: _Coords
    vocab: int

    def full(self, name: str, hf: str) -> PhysicalTensor:
        t = self.by_name[hf]
        return physical(name, t.shape, self._dtype(t), [whole(hf, t.shape)])

    def split(self, key: str) -> tuple[int, int]:
        """(parts, this rank's index) of the TP (`source.tp`) or ETP (`source.etp`) cut."""
        if key == "source.etp":
            return self.cfg.expert_tp, self.c.etp
        return self.cfg.tp, self.c.tp

    def rows(self, name: str, hf: str, key: str = "source.tp") -> PhysicalTensor:
        """Column-parallel: an even row cut."""
        parts, index = self.split(key)
        t = self.by_name[hf]
        lo, hi = even(t.shape[0], parts, index, key, parts, f"rows of {hf}")
        return physical(name, (hi - lo, *t.shape[1:]), self._dtype(t),
                        [box(hf, t.shape, 0, lo, hi)])

    def cols(self, name: str, hf: str, key: str = "source.tp") -> PhysicalTensor:
        """Row-parallel: an even column cut."""
        parts, index = self.split(key)
        t = self.by_name[hf]
        lo, hi = even(t.shape[1], parts, index, key, parts, f"columns of {hf}")
        return physical(name, (t.shape[0], hi - lo), self._dtype(t),
                        [box(hf, t.shape, 1, lo, hi)])

    def gate_up(self, name: str, hf: str, key: str = "source.tp") -> PhysicalTensor:
        """`linear_fc1` = `[gate rows of this rank; up rows of this rank]`."""
        parts, index = self.split(key)
        gate = self.by_name[hf + "gate_proj.weight"]
        inter, h = gate.shape
        lo, hi = even(inter, parts, index, key, parts, f"rows of {gate.name}")
        pieces = [box(gate.name, gate.shape, 0, lo, hi),
                  box(hf + "up_proj.weight", gate.shape, 0, lo, hi, at=hi - lo)]
        return physical(name, (2 * (hi - lo), h), self._dtype(gate), pieces)

    def vocab_rows(self, name: str, hf: str) -> PhysicalTensor:
        t = self.by_name[hf]
        per = self.vocab // self.cfg.tp
        lo, hi = self.c.tp * per, min((self.c.tp + 1) * per, t.shape[0])
        return physical(name, (per, t.shape[1]), self._dtype(t),
                        [box(hf, t.shape, 0, lo, hi)] if lo < hi else [])

    def _dtype(self, t: LogicalTensor) -> str:
        return t.dtype if t.buffer else self.cfg.dtype


def _rank(x: _Ctx, chunks: list[range]) -> Iterator[PhysicalTensor]:
    """The rank's model chunks in order; with VPP each chunk's names start `model{v}.`."""
    for v, layers in enumerate(chunks):
        yield from _chunk(x, layers, f"model{v}." if len(chunks) > 1 else "",
                          first=x.c.pp == 0 and v == 0,
                          last=x.c.pp == x.cfg.pp - 1 and v == len(chunks) - 1)


def _chunk(x: _Ctx, layers: range, pre: str, first: bool, last: bool
           ) -> Iterator[PhysicalTensor]:
    d, cfg = x.d, x.cfg
    buffers: list[PhysicalTensor] = []
    if first:
        yield x.vocab_rows(pre + "embedding.word_embeddings.weight", "model.embed_tokens.weight")
    for j, i in enumerate(layers):
        yield from _layer(x, f"{pre}decoder.layers.{j}.", f"model.layers.{i}.", i, buffers)
    if last:
        yield x.full(pre + "decoder.final_layernorm.weight", "model.norm.weight")
        if not d.tied:
            yield x.vocab_rows(pre + "output_layer.weight", "lm_head.weight")
        elif cfg.pp > 1:  # the last stage holds a copy of the tied embedding
            yield x.vocab_rows(pre + "output_layer.weight", "model.embed_tokens.weight")
    yield from buffers


def _layer(x: _Ctx, m: str, h: str, i: int, buffers: list[PhysicalTensor]
           ) -> Iterator[PhysicalTensor]:
    d, te = x.d, x.cfg.transformer_engine
    moe = d.is_moe(i)
    a = h + "self_attn."
    if not te or d.mla:
        yield x.full(m + "input_layernorm.weight", h + "input_layernorm.weight")
    if d.mla:
        yield from _mla(x, m + "self_attention.", a)
    else:
        yield x.cols(m + "self_attention.linear_proj.weight", a + "o_proj.weight")
        if te:
            yield x.full(m + "self_attention.linear_qkv.layer_norm_weight",
                         h + "input_layernorm.weight")
        yield _qkv(x, m + "self_attention.linear_qkv.weight", a, "weight")
        if d.qkv_bias:
            yield _qkv(x, m + "self_attention.linear_qkv.bias", a, "bias")
        if d.qk_norm:
            yield x.full(m + "self_attention.q_layernorm.weight", a + "q_norm.weight")
            yield x.full(m + "self_attention.k_layernorm.weight", a + "k_norm.weight")
    norm = h + "post_attention_layernorm.weight"
    if not te or moe:
        yield x.full(m + "pre_mlp_layernorm.weight", norm)
    if not moe:
        if te:
            yield x.full(m + "mlp.linear_fc1.layer_norm_weight", norm)
        yield x.gate_up(m + "mlp.linear_fc1.weight", h + "mlp.")
        yield x.cols(m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight")
        return
    yield x.full(m + "mlp.router.weight", h + "mlp.gate.weight")
    yield from _experts(x, m + "mlp.experts.", h + "mlp.experts.")
    if d.shared_intermediate:
        s = h + "mlp.shared_experts."
        yield x.gate_up(m + "mlp.shared_experts.linear_fc1.weight", s)
        yield x.cols(m + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight")
    bias = h + "mlp.gate.e_score_correction_bias"
    if bias in x.by_name:
        buffers.append(replace(x.full(m + "mlp.router.expert_bias", bias), buffer=True))


def _qkv(x: _Ctx, name: str, a: str, kind: str) -> PhysicalTensor:
    """`linear_qkv`: rows interleaved per group `[q heads of g; k_g; v_g]`, even TP cut."""
    d = x.d
    q, hd = d.heads // d.kv_heads, d.head_dim
    segments = []
    for g in range(d.kv_heads):
        segments += [(a + f"q_proj.{kind}", g * q * hd, q * hd),
                     (a + f"k_proj.{kind}", g * hd, hd), (a + f"v_proj.{kind}", g * hd, hd)]
    qt = x.by_name[a + f"q_proj.{kind}"]
    rest = qt.shape[1:]
    per = (d.heads + 2 * d.kv_heads) * hd // x.cfg.tp
    start = x.c.tp * per
    return physical(name, (per, *rest), x.cfg.dtype, cut_rows(segments, rest, start, start + per))


def _mla(x: _Ctx, m: str, a: str) -> Iterator[PhysicalTensor]:
    d, te = x.d, x.cfg.transformer_engine
    down = x.full if te else x.rows  # TE: replicated TELinear; local: column-parallel
    yield x.cols(m + "linear_proj.weight", a + "o_proj.weight")
    if d.q_lora_rank:
        yield down(m + "linear_q_down_proj.weight", a + "q_a_proj.weight")
        if te:
            yield x.full(m + "linear_q_up_proj.layer_norm_weight", a + "q_a_layernorm.weight")
        yield x.rows(m + "linear_q_up_proj.weight", a + "q_b_proj.weight")
    else:
        yield x.rows(m + "linear_q_proj.weight", a + "q_proj.weight")
    yield down(m + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight")
    if te:
        yield x.full(m + "linear_kv_up_proj.layer_norm_weight", a + "kv_a_layernorm.weight")
    yield x.rows(m + "linear_kv_up_proj.weight", a + "kv_b_proj.weight")
    if not te:
        if d.q_lora_rank:
            yield x.full(m + "q_layernorm.weight", a + "q_a_layernorm.weight")
        yield x.full(m + "kv_layernorm.weight", a + "kv_a_layernorm.weight")


def _experts(x: _Ctx, m: str, e: str) -> Iterator[PhysicalTensor]:
    """This rank's experts `[ep_rank*E/EP, ...)`, each split like dense TP over ETP."""
    d, cfg = x.d, x.cfg
    n = d.num_experts // cfg.ep
    first = x.c.ep * n

    def fc1(k: int) -> PhysicalTensor:
        name = (f"{m}linear_fc1.weight{k}" if cfg.expert_layout == "grouped"
                else f"{m}local_experts.{k}.linear_fc1.weight")
        return x.gate_up(name, f"{e}{first + k}.", "source.etp")

    def fc2(k: int) -> PhysicalTensor:
        name = (f"{m}linear_fc2.weight{k}" if cfg.expert_layout == "grouped"
                else f"{m}local_experts.{k}.linear_fc2.weight")
        return x.cols(name, f"{e}{first + k}.down_proj.weight", "source.etp")

    if cfg.expert_layout == "grouped":
        yield from (fc1(k) for k in range(n))
        yield from (fc2(k) for k in range(n))
    else:
        for k in range(n):
            yield fc1(k)
            yield fc2(k)


__all__ = ["check", "chunk_layers", "identity", "layout", "padded_vocab", "stage_layers"]
