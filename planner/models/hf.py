"""Specs from transformers: the model spec of a `model_type` with no hand-written family.

transformers builds the model from the config on the meta device (no weights are
allocated, nothing is downloaded); its `state_dict()` gives every parameter and persistent
buffer. transformers 5.x stores some tensors in its own fused form (Mixtral's
`experts.{e}.w1/w3` as `experts.gate_up_proj [E, 2I, H]`, Qwen-MoE's per-expert
`gate/up/down_proj`): its own `revert_weight_conversion` (what `save_pretrained` runs)
turns them back into checkpoint names, which are the logical names. A tied `lm_head` is
dropped (written once, as `embed_tokens`). Dtypes: the checkpoint dtype, except modules
transformers keeps in fp32 and fp32 buffers (`e_score_correction_bias`).

torch and transformers are imported only here, and only when this path runs: compiling a
hand-written family needs neither (tests/planner/test_no_torch.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from planner.models.base import LogicalTensor, ModelDims, as_2d
from schemas.config import ConfigError

NOT_FOR_TRANSFORMERS = ("auto_map", "quantization_config", "architectures",
                        "transformers_version", "model_type")
"""config.json keys that only matter to custom code or quantized loading."""
LAYER = r"\.(?:layers|h|blocks)\.(\d+)\."
"""Where a checkpoint name carries its decoder layer index."""
CUSTOM_CODE_TYPES = {"kimi_k2": "deepseek_v3"}
"""model_types that ship custom code with the same architecture as a transformers one."""


def known(model_type: object) -> bool:
    """transformers knows this model_type (imports transformers)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and (model_type in CONFIG_MAPPING
                                            or model_type in CUSTOM_CODE_TYPES)


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about a config (token ids outside a tiny vocab...) are not
    ours to print: errors only, restored afterwards."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def config(hf: dict[str, Any]) -> Any:
    """The transformers config object of a parsed config.json."""
    import transformers

    model_type = CUSTOM_CODE_TYPES.get(hf["model_type"], hf["model_type"])
    numbers = {k: v for k, v in hf.items() if k not in NOT_FOR_TRANSFORMERS}
    try:
        with _quiet():
            cfg = transformers.AutoConfig.for_model(model_type, **numbers)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.config: transformers cannot build a {model_type!r} config "
                          f"from config.json ({str(e)[:200]}); fix config.json") from None
    # vLLM's config loader sets `model_type` on the transformers config *class* when it
    # loads an alias (kimi_k2 -> DeepseekV3Config.model_type = "kimi_k2"); transformers
    # looks up its expert conversion by model_type, so pin it on this instance.
    cfg.model_type = model_type
    return cfg


def dims(hf: dict[str, Any]) -> ModelDims:
    """The generic numbers (through transformers' attribute names, so `n_embd` etc. work)."""
    cfg = config(hf)

    def num(name: str, default: int = 0) -> int:
        value = getattr(cfg, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    heads, hidden = num("num_attention_heads"), num("hidden_size")
    return ModelDims(
        model_type=hf["model_type"], num_layers=num("num_hidden_layers"), hidden=hidden,
        heads=heads, kv_heads=num("num_key_value_heads", heads),
        head_dim=num("head_dim", hidden // heads if heads > 0 else 0),
        intermediate=num("intermediate_size"), vocab=num("vocab_size"),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)))


def state(hf: dict[str, Any], dtype: str) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """Checkpoint name -> (shape, dtype, is a buffer), in transformers' checkpoint form.
    The tied `lm_head` is kept (callers decide)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = config(hf)
    with torch.device("meta"), _quiet():
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        except (ValueError, TypeError, AssertionError) as e:  # what its builders raise
            raise ConfigError(f"model.config: transformers cannot build a causal LM for "
                              f"model_type {hf['model_type']!r} from config.json "
                              f"({str(e)[:160]}); fix config.json") from None
    params = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()}
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    out = {}
    for name, t in revert_weight_conversion(model, dict(params)).items():
        # buffers and fp32 modules keep their names (only experts are fused)
        dt = "float32" if any(m in name for m in fp32) else str(t.dtype).removeprefix("torch.")
        out[name] = (tuple(t.shape), dt, name in buffers)
    return out


def _order(name: str) -> tuple[int, int]:
    """Checkpoint order: embeddings, layers by index, then the rest (norm, lm_head)."""
    m = re.search(LAYER, name)
    if m:
        return (1, int(m.group(1)))
    if "embed" in name:
        return (0, 0)
    return (3, 0) if name.startswith("lm_head") else (2, 0)


def tensors(hf: dict[str, Any], d: ModelDims, dtype: str) -> list[LogicalTensor]:
    """The logical tensors, in checkpoint order (stable within a layer)."""
    found = state(hf, dtype)
    if d.tied:
        found.pop("lm_head.weight", None)
    names = sorted(found, key=_order)
    out = []
    for name in names:
        shape, dt, buffer = found[name]
        m = re.search(LAYER, name)
        out.append(as_2d(name, shape, dt, int(m.group(1)) if m else -1, buffer))
    return out
