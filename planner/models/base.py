"""The model's data that every family builds: logical tensors, the numbers layouts need
(`ModelDims`), and `require`, a config.json key or one ConfigError naming it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from schemas.config import ConfigError


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    name: str
    """Checkpoint name, e.g. `model.layers.0.self_attn.q_proj.weight`."""
    shape: tuple[int, ...]
    """Checkpoint shape; weights are `[out, in]`."""
    dtype: str
    """Checkpoint dtype (`bfloat16`; `float32` for fp32 buffers)."""
    layer: int = -1
    """Decoder layer index (global), or -1 outside the layers."""
    buffer: bool = False
    """A trained buffer, not a parameter (kept in its own dtype on both sides)."""
    mtp: bool = False
    """Part of a multi-token-prediction layer (in checkpoints, not in the HF model)."""
    stored: tuple[int, ...] = ()
    """The checkpoint's shape when it has more than 2 dims (gpt-oss's fused experts
    `[E, H, 2I]`); `shape` is then its row-major 2-d view `[E*H, 2I]` (the same bytes),
    since boxes are 2-d. Empty when `shape` is the checkpoint shape."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        return self.stored or self.shape


def as_2d(name: str, shape: tuple[int, ...], dtype: str, layer: int = -1,
          buffer: bool = False) -> LogicalTensor:
    """A logical tensor of any rank: more than 2 dims are viewed as `[prod(lead), last]`."""
    if len(shape) <= 2:
        return LogicalTensor(name, shape, dtype, layer, buffer)
    return LogicalTensor(name, (math.prod(shape[:-1]), shape[-1]), dtype, layer, buffer,
                         stored=shape)


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The numbers of a model that layouts need. 0 means absent."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()
    """Global indices of the MoE layers, MTP layers (indices >= num_layers) included."""
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    moe_module: str = "mlp"
    """The MoE block's module name inside a layer (Mixtral: `block_sparse_moe`)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of an expert's gate, up and down projections (Mixtral: w1, w3, w2)."""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers



def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ConfigError(f"model.config: key {key!r} is missing from config.json for "
                          f"model_type {hf.get('model_type')!r}; add it")
    return hf[key]
