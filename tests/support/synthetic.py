"""Hand-built layouts for compiler tests, independent of the framework layout modules.

- `row_split(spec, world, dtype)`: each logical tensor `torch.chunk`ed along dim 0 over
  `world` ranks, one physical tensor per piece (FSDP2-like; trailing ranks may be empty).
- `fused_col_split(spec, tp, replicas, dtype)`: q/k/v of each layer fused into one `qkv`
  tensor `[q; k; v]`, every 2-d tensor split along dim 1 (columns) over `tp` ranks, 1-d
  tensors replicated: so every target box is strided in its physical tensor, and every
  source row is cut (exercises runs, packs and unpacks).
"""

from __future__ import annotations

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig

# A small Qwen3 (hidden 64, 4 heads of 16, 2 KV heads) from 3 FSDP2 ranks into 2 vLLM TP
# ranks x 2 replicas, colocated on hosts of 4 GPUs: the compiler tests' standard case.


def row_split(spec: ModelSpec, world: int, dtype: str = "bfloat16") -> Layout:
    ranks = []
    for r in range(world):
        tensors = []
        for t in spec.tensors:
            d0 = t.shape[0]
            c = -(-d0 // world)
            lo, hi = min(r * c, d0), min((r + 1) * c, d0)
            shape = (hi - lo, *t.shape[1:])
            pieces = () if hi == lo else (
                Piece(t.name, (lo, *[0] * (len(t.shape) - 1)), shape, (0,) * len(shape)),)
            tdtype = t.dtype if t.buffer else dtype
            tensors.append(PhysicalTensor(t.name, shape, tdtype, pieces))
        ranks.append(RankLayout(r, 0, tuple(tensors)))
    return Layout("source", "synthetic-rows", tuple(ranks), 1)


def fused_col_split(spec: ModelSpec, tp: int, replicas: int = 1,
                    dtype: str = "bfloat16") -> Layout:
    by_name = spec.by_name
    ranks = []
    for rep in range(replicas):
        for r in range(tp):
            tensors = []
            done = set()
            for t in spec.tensors:
                if t.name in done:
                    continue
                tdtype = t.dtype if t.buffer else dtype
                if t.name.endswith("q_proj.weight") and "self_attn" in t.name:
                    group = [by_name[t.name.replace("q_proj", x)] for x in ("q_proj", "k_proj",
                                                                           "v_proj")]
                    name = t.name.replace("q_proj", "qkv_proj")
                else:
                    group, name = [t], t.name
                done.update(g.name for g in group)
                if len(t.shape) == 1:
                    tensors.append(PhysicalTensor(name, t.shape, tdtype, (
                        Piece(t.name, (0,), t.shape, (0,)),)))
                    continue
                cols = t.shape[1] // tp
                rows = sum(g.shape[0] for g in group)
                pieces, row = [], 0
                for g in group:
                    pieces.append(Piece(g.name, (0, r * cols), (g.shape[0], cols), (row, 0)))
                    row += g.shape[0]
                tensors.append(PhysicalTensor(name, (rows, cols), tdtype, tuple(pieces)))
            ranks.append(RankLayout(rep * tp + r, rep, tuple(tensors)))
    return Layout("target", "synthetic-cols", tuple(ranks), replicas)


SMALL_HF = dict(model_type="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, intermediate_size=96, vocab_size=101, num_hidden_layers=2,
          tie_word_embeddings=False)


def small_config(**opts) -> Config:
    return Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=3),
                  target=TargetConfig("vllm", tp=2, replicas=2),
                  cluster=ClusterConfig(gpus_per_host=4, nics_per_host=2,
                                        placement="colocated", source_gpus_per_host=2),
                  options=Options(**opts))


# Block-FP8 targets: hidden 256, 2 heads of 128 (1 KV head), intermediate 512, so a 2-way
# column split of the target keeps every shard on the 128-grid.
FP8_HF = dict(model_type="qwen3", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
          head_dim=128, intermediate_size=512, vocab_size=101, num_hidden_layers=2,
          tie_word_embeddings=False)


def fp8_config(**opts) -> Config:
    return Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=3),
                  target=TargetConfig("vllm", tp=2, replicas=2, dtype="fp8_block128"),
                  cluster=ClusterConfig(gpus_per_host=8, nics_per_host=2),
                  options=Options(**opts))


# A one-layer llama with 8x8 weights (128 bytes each in bf16) and 8-element norms (16 bytes).
TINY = dict(model_type="llama", hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
            head_dim=8, intermediate_size=8, vocab_size=8, num_hidden_layers=1,
            tie_word_embeddings=True)


def whole_tensors(spec: ModelSpec, side: str, dtype: str, world: int = 1) -> Layout:
    """Every rank holds every logical tensor whole, under its checkpoint name."""
    tensors = tuple(PhysicalTensor(t.name, t.shape, dtype, (
        Piece(t.name, (0,) * len(t.shape), t.shape, (0,) * len(t.shape)),))
        for t in spec.tensors)
    return Layout(side, "hand", tuple(RankLayout(r, r, tensors) for r in range(world)),
                  world)  # type: ignore[arg-type]


def tiny_config(**opts: int) -> Config:
    """1 fp32 FSDP2 rank -> 1 vLLM rank on a host of 1 GPU (options: `opts`)."""
    return Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dtype="float32"),
                  target=TargetConfig("vllm"),
                  cluster=ClusterConfig(gpus_per_host=1, nics_per_host=1),
                  options=Options(**opts))


def fsdp2_to_vllm_plan(opts: dict, placement: str):
    """A compiled plan of a tiny Qwen3: FSDP2 dp 3 into 2 vLLM TP 2 engines, 4 GPUs and 2 NICs
    a host, `placement` colocated (2 source GPUs a host) or disaggregated, `opts` its options."""
    from planner.compiler import compile_layouts
    from planner.spec import spec_from_hf

    hf = dict(model_type="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=96, vocab_size=101, num_hidden_layers=2,
              tie_word_embeddings=False)
    spec = spec_from_hf(hf)
    extra = {"source_gpus_per_host": 2} if placement == "colocated" else {}
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=3),
                 target=TargetConfig("vllm", tp=2, replicas=2),
                 cluster=ClusterConfig(gpus_per_host=4, nics_per_host=2, placement=placement,
                                       **extra),
                 options=Options(**opts))
    return compile_layouts(cfg, spec, row_split(spec, 3), fused_col_split(spec, 2, 2))


MOE_GATHER = dict(model_type="qwen3_moe", hidden_size=512, num_attention_heads=4,
           num_key_value_heads=1, head_dim=128, intermediate_size=512,
           moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=300,
           num_hidden_layers=2, tie_word_embeddings=False, torch_dtype="bfloat16")
"""A small Qwen3-MoE whose experts the FP8 gather path stages (the gather tests' model)."""
