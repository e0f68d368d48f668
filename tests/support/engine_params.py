"""An engine's loaded parameters against what a layout says its rank holds: the layout
oracles' one comparison (real vLLM, real SGLang)."""

from __future__ import annotations

import torch


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                engine: str) -> list[str]:
    """What differs between `engine`'s `named_parameters()` (`got`) and the layout's
    tensors of the rank (`want`): a name missing on either side, their order, and each
    tensor's shape, dtype and values (bit for bit); empty when they agree."""
    errors = [f"missing in {engine}: {n}" for n in want if n not in got]
    errors += [f"not in our layout: {n} {tuple(got[n].shape)}" for n in got if n not in want]
    if not errors and list(got) != list(want):
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        errors.append(f"named_parameters() order differs at {i}: {engine} "
                      f"{list(got)[i:i + 4]}, ours {list(want)[i:i + 4]}")
    for name in want.keys() & got.keys():
        g, w = got[name], want[name]
        if g.shape != w.shape or g.dtype != w.dtype:
            errors.append(f"{name}: {engine} {tuple(g.shape)} {g.dtype}, ours "
                          f"{tuple(w.shape)} {w.dtype}")
        elif not torch.equal(g, w):
            bad = (g != w).nonzero()
            errors.append(f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}")
    return errors
