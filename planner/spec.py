"""Pass 1 (`spec`): a HF `config.json` -> the model spec, the ordered logical tensors.

Logical tensors carry checkpoint names and shapes (`model.layers.3.mlp.experts.7.gate_proj
.weight`), one per parameter or trained buffer, as a HF checkpoint stores them. The numbers
a layout needs (heads, groups, experts...) are collected once in `ModelDims`. Each model
family is one data-heavy module in `planner/models/`.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from planner.models import deepseek_v3, dense, glm4_moe, gpt_oss, mixtral, qwen3_moe
from planner.models.base import LogicalTensor, ModelDims
from schemas.config import ConfigError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    dims: ModelDims
    tensors: tuple[LogicalTensor, ...]
    _by_name: dict[str, LogicalTensor] = field(init=False, repr=False, compare=False)
    """Index built once (Kimi-K2 has ~70k tensors); read it through `by_name`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    @property
    def by_name(self) -> dict[str, LogicalTensor]:
        """name -> tensor (built once; do not modify it)."""
        return self._by_name

    @property
    def total_params(self) -> int:
        """Parameters of the HF model: MTP layers excluded, tied embeddings counted once."""
        return sum(t.numel for t in self.tensors if not t.mtp)

    @property
    def mtp_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.mtp)


FAMILIES: dict[str, Any] = {
    "llama": dense, "qwen2": dense, "qwen3": dense, "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3, "kimi_k2": deepseek_v3, "mixtral": mixtral,
    "glm4_moe": glm4_moe, "gpt_oss": gpt_oss}
"""The hand-written model families: `model_type` -> its module in `planner/models/`."""
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
"""The model types with hand-written rules (any other is read through transformers)."""


def read_hf_config(path: str) -> dict[str, Any]:
    """Read a HF config.json (a regular file of at most `schemas.safe_read.MAX_FILE_BYTES`),
    with clear errors for a missing, oversized or broken file."""
    from schemas.safe_read import read_text, short

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    text = read_text(path, "model.config", "the model's HF config.json")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.config: {path!r} is not valid JSON (line {e.lineno}: "
                          f"{e.msg}); use the model's HF config.json") from None
    except RecursionError:
        raise ConfigError(f"model.config: {path!r} nests too deeply for a config.json; use "
                          "the model's HF config.json") from None
    except ValueError as e:  # NaN, Infinity, an int of more than 4300 digits
        raise ConfigError(f"model.config: {path!r} holds a value no HF config.json has "
                          f"({short(str(e), 60)[1:-1]}); use the model's HF config.json"
                          ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.config: {path!r} holds {type(data).__name__}, not a JSON "
                          "object; use the model's HF config.json")
    return data


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def spec_from_hf(hf: dict[str, Any], num_layers: int | None = None,
                 overrides: tuple[tuple[str, Any], ...] = (), mtp: bool = True) -> ModelSpec:
    """The model spec of a parsed HF config (with optional overrides)."""
    _check_overrides(hf, overrides)
    hf = dict(hf)
    hf.update(dict(overrides))
    _check_int_keys(hf, dict(overrides))
    if num_layers is not None:
        from schemas.config import MAX_LAYERS

        if not 1 <= num_layers <= MAX_LAYERS:
            raise ConfigError(f"model.num_layers: {num_layers} must be 1..{MAX_LAYERS}")
        hf["num_hidden_layers"] = num_layers
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type)
    hand_written = family is not None
    if not hand_written:
        family = _from_transformers(model_type)
    dims = family.dims(hf)
    if not mtp:
        dims = replace(dims, mtp_layers=0,
                       moe_layers=tuple(i for i in dims.moe_layers if i < dims.num_layers))
    _check_dims(dims)
    layers = dims.num_layers + dims.mtp_layers
    if layers * (3 * dims.num_experts + 32) > MAX_TENSORS:
        raise ConfigError(f"model.config: {layers} layers of {dims.num_experts} experts make "
                          f"more than {MAX_TENSORS:,} tensors; fix config.json or "
                          "model.overrides")
    if hand_written:
        return ModelSpec(dims=dims, tensors=tuple(family.tensors(dims, _dtype(hf))))
    return ModelSpec(dims=dims, tensors=tuple(family.tensors(hf, dims, _dtype(hf))))


def _from_transformers(model_type: object) -> Any:
    """`planner.models.hf` for a model_type transformers knows (imports transformers)."""
    try:
        from planner.models import hf
        known = hf.known(model_type)
    except ImportError:
        known, hf = False, None
    if not known:
        raise ConfigError(f"model.config: model_type {model_type!r} is not supported: no "
                          "hand-written family and transformers does not know it (or is not "
                          f"installed); hand-written: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return hf


# The integer numbers the families read; null is allowed (e.g. `q_lora_rank: null`).
INT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "num_experts", "n_routed_experts",
            "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok",
            "decoder_sparse_step", "first_k_dense_replace", "num_local_experts",
            "moe_layer_freq", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "num_nextn_predict_layers")


def _check_overrides(hf: dict[str, Any], overrides: tuple[tuple[str, Any], ...]) -> None:
    """An override must name a key of config.json or a number the families read."""
    for key, _ in overrides:
        if key not in hf and key not in INT_KEYS:
            close = difflib.get_close_matches(key, [*hf, *INT_KEYS], 1)
            hint = f"did you mean {close[0]}?" if close else "check the spelling"
            raise ConfigError(f"model.overrides.{key}: not a key of this config.json; {hint}")


MAX_DIM = 1 << 24
"""Largest model number (hidden, vocab, intermediate...); the real ones are below 2**18."""
MAX_TENSORS = 1_000_000
"""Most logical tensors a spec may have (Kimi-K2 has ~71k)."""


def _check_int_keys(hf: dict[str, Any], overrides: dict[str, Any]) -> None:
    from schemas.config import MAX_LAYERS
    from schemas.safe_read import short

    for key in INT_KEYS:
        value = hf.get(key)
        where = f"model.overrides.{key}" if key in overrides else f"model.config: {key}"
        fix = "model.overrides" if key in overrides else "config.json"
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{where}: {short(value)} must be an integer; fix {fix}")
        cap = MAX_LAYERS if key in ("num_hidden_layers", "num_nextn_predict_layers") else MAX_DIM
        if value is not None and value > cap:
            raise ConfigError(f"{where}: {short(value)} is more than {cap:,}; fix {fix}")


def load_spec(path: str, num_layers: int | None = None,
              overrides: tuple[tuple[str, Any], ...] = (), mtp: bool = True) -> ModelSpec:
    return spec_from_hf(read_hf_config(path), num_layers, overrides, mtp)


def _dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"


_HF_KEYS = {"num_layers": "num_hidden_layers", "hidden": "hidden_size",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "vocab": "vocab_size", "intermediate": "intermediate_size",
            "num_experts": "num_experts", "moe_intermediate": "moe_intermediate_size",
            "mtp_layers": "num_nextn_predict_layers"}


def _check_dims(d: ModelDims) -> None:
    def bad(name: str, rule: str) -> ConfigError:
        return ConfigError(f"model.config: {_HF_KEYS[name]} = {getattr(d, name)} {rule}; "
                           "fix config.json or model.overrides")

    for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(d, name) < 1:
            raise bad(name, "must be positive")
    for name in ("intermediate", "num_experts", "moe_intermediate", "mtp_layers"):
        if getattr(d, name) < 0:
            raise bad(name, "must not be negative")
    if d.num_experts and d.moe_intermediate < 1:
        raise bad("moe_intermediate", "must be positive for a model with experts")
    if d.heads % d.kv_heads:
        raise ConfigError(f"model.config: num_attention_heads={d.heads} is not a multiple of "
                          f"num_key_value_heads={d.kv_heads}; fix config.json")
