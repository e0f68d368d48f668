"""Derived state: which runtime tensors of a target rank depend on the bytes a plan writes.

An inference engine derives some tensors from the loaded weights after loading (vLLM's
`process_weights_after_loading`, SGLang's post-load hooks). A raw write into the weights
leaves a derived *copy* stale; a derived *view* of the written storage stays right. The
compiler records, per target rank, the derived tensors that are copies, so that the
engine-side integration refreshes exactly those after every complete update.

The header key `derived` (engine-neutral, plain msgpack data): a list with one entry per
plan rank (sources: `[]`), each a list of refresh entries:

    {"rule": str,           # what to re-run; the integration of `engine` owns its meaning
     "engine": str,         # "vllm" or "sglang"
     "module": str,         # the native module prefix the rule applies to
     "reads": [str, ...],   # the rank's plan tensors (regions) the derived state reads
     "writes": [str, ...]}  # the derived tensors (attributes of the engine's module)

Each engine's rules live in its layout module's `derived_rank`: SGLang's (`mla_split`:
`w_kc`/`w_vc` copies of `kv_b_proj`, in every dtype) in `planner/layouts/sglang.py`; vLLM
0.33's in `planner/layouts/vllm.py` (checked against vLLM's own post-load state on CPU,
tests/integrations/test_vllm_engine.py):

- `mla_absorb`: MLA's `W_UK_T` `[heads, nope, kv_lora]` and `W_UV` `[heads, kv_lora, v]`
  are re-derived from `kv_b_proj` by `MLAAttention.process_weights_after_loading`. With an
  unquantized `kv_b_proj` they are views of its weight (nothing to refresh); with a block-FP8
  `kv_b_proj` they are dequantized copies: listed. `module` is the attention prefix that owns
  `kv_b_proj` (`model.layers.N.self_attn`).

Everything else vLLM 0.33 derives on these paths (rotary caches, attention q/k/v scales
reset to 1.0) does not read transferred bytes; a tied `lm_head` shares `embed_tokens`'
storage; bf16/fp32 dense, MoE and MLA parameters keep their storage through post-load
processing. Engine-side re-layouts that a plan does not write (MoE kernel repacks, CPU
GEMM packing) are refused by the integration at init, not listed here.
"""

from __future__ import annotations

from typing import Any

from planner import frameworks
from planner.layouts.base import Layout
from schemas.config import TargetConfig


def derived(dst: Layout, sources: int, target: TargetConfig) -> list[list[dict[str, Any]]]:
    """The header's `derived` list: `[]` for each source rank, then each target rank's
    refresh entries (plan rank = `sources + target rank`), from the engine's
    `derived(rank_layout)` (`planner/frameworks.py`)."""
    rule = frameworks.of(target).derived
    return [[] for _ in range(sources)] + [rule(r) for r in dst.ranks]
