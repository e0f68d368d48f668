"""Trace a few layers, not all of them: decoder layers that look alike on a rank load alike.

A trace offers vLLM's `load_weights` every checkpoint tensor (a large MoE has tens of
thousands of expert tensors per rank). Layers whose checkpoint tensors *and* whose parameters on
this rank have the same names (less the layer index), shapes and dtypes form a class
(`layer_classes`): all MoE layers of a stage, the dense first layers, the layers of
another PP stage (no parameters here). Only a few members of each class are traced, the
first, middle and last (`representatives`); `extrapolate` checks that the middle and last
members' pieces are the first's with the layer index renamed, and gives every other
member the first's pieces renamed. If any member disagrees (a loader that treats layer
`i` by its index), it returns None and the caller traces the rank whole. torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from planner.layouts.base import Piece

LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
"""Where a checkpoint or parameter name carries its decoder layer index."""

Entry = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype) of a checkpoint tensor or a parameter."""


def layer_of(name: str) -> int | None:
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def relayer(name: str, src: int, dst: int) -> str:
    """`name` with its layer index `src` replaced by `dst` (other names unchanged)."""
    m = LAYER.search(name)
    if m is None or int(m.group(1)) != src:
        return name
    return name[:m.start(1)] + str(dst) + name[m.end(1):]


Signatures = dict[int, list[Entry]]
"""Per layer index, its entries with the index replaced by -1."""


def signatures(entries: Iterable[Entry]) -> Signatures:
    out: Signatures = {}
    for name, shape, dtype in entries:
        m = LAYER.search(name)  # once a name: `layer_of`, then `relayer` to -1
        if m is not None:
            out.setdefault(int(m.group(1)), []).append(
                (name[:m.start(1)] + "-1" + name[m.end(1):], shape, dtype))
    return out


def layer_classes(checkpoint: Sequence[Entry], params: Sequence[Entry]) -> list[list[int]]:
    """The checkpoint's layers grouped by (checkpoint signature, parameter signature on
    this rank), each class in layer order."""
    return classes(signatures(checkpoint), params)


def classes(ck: Signatures, params: Sequence[Entry]) -> list[list[int]]:
    """`layer_classes` from the checkpoint's `signatures`, the same for every rank (a
    tracer computes them once for all its ranks)."""
    pa = signatures(params)
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(ck):
        key = (tuple(ck[layer]), tuple(pa.get(layer, ())))
        groups.setdefault(key, []).append(layer)
    return list(groups.values())


def representatives(classes: Sequence[Sequence[int]]) -> set[int]:
    """The layers to trace: the first, middle and last of each class."""
    return {c[i] for c in classes for i in {0, len(c) // 2, len(c) - 1}}


def _renamed(pieces: Sequence[Piece], src: int, dst: int) -> list[Piece]:
    """`pieces` with their tensors' layer `src` renamed `dst` (each name renamed once)."""
    names: dict[str, str] = {}
    out = []
    for p in pieces:
        name = names.get(p.tensor)
        if name is None:
            name = names[p.tensor] = relayer(p.tensor, src, dst)
        out.append(Piece(name, p.offsets, p.sizes, p.at, p.dims))
    return out


def extrapolate(classes: Sequence[Sequence[int]], params: Sequence[str],
                pieces: dict[str, list[Piece]]) -> dict[str, list[Piece]] | None:
    """Every parameter's pieces from the traced representatives (`pieces` holds theirs
    and the non-layer parameters'); None if a traced member disagrees with its class's
    first member renamed."""
    by_layer: dict[int, list[str]] = {}
    for name in params:
        layer = layer_of(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append(name)
    out = {name: list(pieces.get(name, ())) for name in params}
    for members in classes:
        first = members[0]
        traced = representatives([members])
        for layer in members[1:]:
            for name in by_layer.get(layer, ()):
                want = _renamed(pieces.get(relayer(name, layer, first), ()), first, layer)
                if layer in traced:
                    if sorted(want, key=_order) != sorted(out[name], key=_order):
                        return None
                else:
                    out[name] = want
    return out


def _order(p: Piece) -> tuple:
    return (p.at, p.tensor, p.offsets)
