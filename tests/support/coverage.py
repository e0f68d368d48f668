"""Checks shared by the source-layout tests: geometry of pieces and coverage of the model.

`pieces_fit`: every piece lies inside its physical tensor and no two pieces of one
physical tensor overlap. `coverage`: how many times each logical element is held within
each replica group (numpy counts per logical tensor; padding is no piece, so never counted).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from planner.layouts.base import Layout, PhysicalTensor, RankLayout
from planner.spec import ModelSpec


def pieces_fit(pt: PhysicalTensor) -> None:
    seen = np.zeros(pt.shape, dtype=np.int8)
    for p in pt.pieces:
        assert len(p.offsets) == len(p.sizes), (pt.name, p)
        assert len(p.at) == len(pt.shape), (pt.name, p)
        stop = [a + s for a, s in zip(p.at, p.phys_sizes())]
        assert all(a >= 0 for a in p.at) and all(
            s <= n for s, n in zip(stop, pt.shape)), f"{pt.name}: {p} outside {pt.shape}"
        region = tuple(slice(a, b) for a, b in zip(p.at, stop))
        seen[region] += 1
    assert seen.max(initial=0) <= 1, f"{pt.name}: pieces overlap"


def coverage(spec: ModelSpec, layout: Layout,
             group: Callable[[RankLayout, PhysicalTensor, str], int]
             ) -> dict[tuple[int, str], np.ndarray]:
    """{(replica group, logical tensor): count of holders per element}.

    `group(rank, physical tensor, logical name)` says which replica a holding belongs to.
    """
    shapes = {t.name: t.shape for t in spec.tensors}
    counts: dict[tuple[int, str], np.ndarray] = {}
    for rl in layout.ranks:
        for pt in rl.tensors:
            pieces_fit(pt)
            for p in pt.pieces:
                assert p.tensor in shapes, f"{pt.name}: unknown logical tensor {p.tensor}"
                assert all(o >= 0 and o + s <= n for o, s, n in
                           zip(p.offsets, p.sizes, shapes[p.tensor])), (pt.name, p)
                key = (group(rl, pt, p.tensor), p.tensor)
                if key not in counts:
                    counts[key] = np.zeros(shapes[p.tensor], dtype=np.int32)
                counts[key][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))] += 1
    return counts
