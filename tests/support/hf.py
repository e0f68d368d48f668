"""Load logical (checkpoint-named) tensors into a transformers model, fused experts included
(transformers 5.x stacks experts as `experts.gate_up_proj [E, 2I, H]` / `down_proj`)."""

from __future__ import annotations

import torch


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                pre = name[: -len("gate_up_proj")]
                p.copy_(torch.stack([torch.cat([full[f"{pre}{e}.gate_proj.weight"],
                                                full[f"{pre}{e}.up_proj.weight"]])
                                     for e in range(p.shape[0])]))
            elif name.endswith("experts.down_proj"):
                pre = name[: -len("down_proj")]
                p.copy_(torch.stack([full[f"{pre}{e}.down_proj.weight"]
                                     for e in range(p.shape[0])]))
            elif name in full:
                p.copy_(full[name])
