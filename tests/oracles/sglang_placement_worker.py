"""SGLang 0.5.23's own `ExpertLocationMetadata` (its EPLB table), set as the process-wide
metadata SGLang's expert location updater keeps, read by `placement_check.sglang_current`
(the SGLang target's reader, which its engine core's `begin` checks against the plan's): the
same placement passes, another is refused in one line. Exits non-zero on a difference."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    from tests.oracles import sglang_env

    sglang_env.prepare()
    import numpy as np
    import torch
    from sglang.srt.eplb import expert_location as el

    from integrations import placement_check
    from integrations.errors import PlacementMismatchError
    from schemas.placement import Placement

    rng = np.random.default_rng(4)
    table = np.array([rng.permutation(np.r_[np.arange(8), [2, 5]]) for _ in range(3)])
    p2l = torch.tensor(table)
    l2a = torch.full((3, 8, 10), -1, dtype=torch.int64)
    for layer in range(3):
        seen = [0] * 8
        for slot, e in enumerate(table[layer].tolist()):
            l2a[layer, e, seen[e]] = slot
            seen[e] += 1
    meta = el.ExpertLocationMetadata(
        physical_to_logical_map=p2l, physical_to_logical_map_cpu=p2l,
        logical_to_all_physical_map=l2a, logical_to_all_physical_map_cpu=l2a,
        logical_to_all_physical_map_num_valid=torch.count_nonzero(l2a != -1, dim=-1),
        ep_size=2, logical_to_rank_dispatch_physical_map=None)
    el.set_global_expert_location_metadata(meta)

    def begin(plan: Placement | None) -> None:  # what the SGLang target's core begins with
        placement_check.check(placement_check.sglang_current(plan), plan, "SGLang target")

    begin(Placement(table))
    other = table.copy()
    other[1] = np.roll(other[1], 1)
    try:
        begin(Placement(other))
    except PlacementMismatchError as e:
        line = str(e)
        assert "\n" not in line and "MoE layer 1 physical expert" in line, line
        print("refused:", line)
    else:
        sys.exit("a plan for another placement was not refused")
    try:
        begin(None)
    except PlacementMismatchError as e:
        print("refused:", e)
    else:
        sys.exit("a plan for the default placement was not refused on a replicated engine")


if __name__ == "__main__":
    main()
