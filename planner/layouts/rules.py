"""The wording of layout config rules: each rule names the key, the value and the fix.

The rules themselves live in each layout module's `check(spec, cfg)` (the only place a
framework's constraint is written); this module only holds the helpers they share, so
every message lists the valid choices the same way (each raised by `schemas.config.fail`,
the one wording of a config error: key, value, fix).
"""

from __future__ import annotations

from planner.spec import ModelDims
from schemas.config import fail


def divisors(n: int, limit: int = 64) -> str:
    """The divisors of `n` up to `limit`, as `1, 2, 4, 8` (the sizes a user may pick)."""
    return ", ".join(str(k) for k in range(1, min(n, limit) + 1) if n % k == 0)


def divides(key: str, value: int, n: int, what: str) -> None:
    """`value` (of `key`) must divide the model number `n`, named `what`."""
    if n % value:
        fail(key, value, f"must divide {what}={n}; use one of {divisors(n)}")


def attention_tp(key: str, value: int, tp: int, d: ModelDims) -> None:
    """Heads split evenly over `tp`; KV groups either split evenly or replicated whole
    (Megatron's `ng % tp or tp % ng`, vLLM's and SGLang's KV-head replication)."""
    if d.heads % tp:
        fail(key, value, f"must divide num_attention_heads={d.heads}"
             + (f" (attention tp {tp})" if tp != value else "")
             + f"; use one of {divisors(d.heads)}")
    if not d.mla and d.kv_heads % tp and tp % d.kv_heads:
        fail(key, value, f"must divide num_key_value_heads={d.kv_heads} or be a multiple of it "
             "(GQA groups are split or replicated whole)")


def has_dense_layers(d: ModelDims) -> bool:
    return any(not d.is_moe(i) for i in range(d.num_layers))


def mlp_tp(key: str, tp: int, d: ModelDims) -> None:
    """Dense MLPs and shared experts split their intermediate size over `tp`."""
    if has_dense_layers(d):
        divides(key, tp, d.intermediate, "intermediate_size")
    if d.shared_intermediate:
        divides(key, tp, d.shared_intermediate, "the shared experts' intermediate size")


def pp_fits(key: str, pp: int, d: ModelDims) -> None:
    if pp > d.num_layers:
        fail(key, pp, f"exceeds the model's {d.num_layers} layers; use at most "
             f"{d.num_layers} stages")


def has_rules(key: str, value: object, d: ModelDims, families: tuple[str, ...]) -> None:
    """A hand-written layout covers only the families it was written for (a model_type
    whose spec comes from transformers has no rules)."""
    if d.model_type not in families:
        fail(key, value, f"has no layout rules for model_type {d.model_type!r}; it has rules "
             f"for {', '.join(families)}")
