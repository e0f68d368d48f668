"""`planner/layouts/trace_layers.py`: which layers a trace runs and how the rest follow.

Hand-written geometry: a 6-layer model whose layer 0 is dense and layers 1-5 are MoE
(`experts.w13` [4, 8]); on a PP rank holding layers 0-3 only, layers 4-5 have no
parameters and form their own class."""

from __future__ import annotations

from planner.layouts.base import Piece
from planner.layouts.trace_layers import (
    extrapolate,
    layer_classes,
    layer_of,
    relayer,
    representatives,
)


def ck(layer: int, moe: bool) -> list[tuple[str, tuple[int, ...], str]]:
    p = f"model.layers.{layer}."
    body = [(p + "mlp.experts.0.w1.weight", (4, 8), "bf16")] if moe else [
        (p + "mlp.up_proj.weight", (16, 8), "bf16")]
    return [(p + "input_layernorm.weight", (8,), "bf16")] + body


def param(layer: int, moe: bool) -> list[tuple[str, tuple[int, ...], str]]:
    p = f"model.layers.{layer}."
    return [(p + ("mlp.experts.w13" if moe else "mlp.up"), (4, 8), "bf16")]


CHECKPOINT = [("model.embed_tokens.weight", (10, 8), "bf16")] + [
    e for i in range(6) for e in ck(i, i > 0)]
PARAMS = [("model.embed_tokens.weight", (10, 8), "bf16")] + [
    e for i in range(4) for e in param(i, i > 0)]


def piece(layer: int, at: int = 0) -> Piece:
    return Piece(f"model.layers.{layer}.mlp.experts.0.w1.weight", (0, 0), (4, 8), (at, 0))


def test_names_and_classes() -> None:
    assert layer_of("model.layers.12.mlp.gate.weight") == 12 and layer_of("lm_head.weight") is None
    assert relayer("model.layers.12.mlp.gate.weight", 12, 3) == "model.layers.3.mlp.gate.weight"
    assert relayer("model.layers.12.mlp.gate.weight", 4, 3) == "model.layers.12.mlp.gate.weight"
    assert layer_classes(CHECKPOINT, PARAMS) == [[0], [1, 2, 3], [4, 5]]
    assert representatives([[0], [1, 2, 3, 4, 5, 6], [7, 8]]) == {0, 1, 4, 6, 7, 8}


def test_untraced_members_get_the_first_members_pieces_renamed() -> None:
    names = [n for n, _, _ in PARAMS]
    classes = [[0], [1, 2, 3, 4, 5, 6]]
    names += [f"model.layers.{i}.mlp.experts.w13" for i in (4, 5, 6)]
    traced = {f"model.layers.{i}.mlp.experts.w13": [piece(i)] for i in (1, 4, 6)}
    out = extrapolate(classes, names, traced)
    assert out is not None
    for i in (2, 3, 5):
        assert out[f"model.layers.{i}.mlp.experts.w13"] == [piece(i)]
    assert out["model.embed_tokens.weight"] == []


def test_a_member_that_loads_differently_means_trace_all() -> None:
    names = [f"model.layers.{i}.mlp.experts.w13" for i in range(1, 7)]
    traced = {f"model.layers.{i}.mlp.experts.w13": [piece(i)] for i in (1, 4)}
    traced["model.layers.6.mlp.experts.w13"] = [piece(6, at=1)]  # lands elsewhere
    assert extrapolate([[1, 2, 3, 4, 5, 6]], names, traced) is None
    traced["model.layers.6.mlp.experts.w13"] = [piece(6), piece(6, at=1)]  # one more copy
    assert extrapolate([[1, 2, 3, 4, 5, 6]], names, traced) is None
