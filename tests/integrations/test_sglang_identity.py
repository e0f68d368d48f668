"""integrations/sglang.py without SGLang: identity, derived entries, refusals (the plan rank:
tests/integrations/test_adapter_plan_rank.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from integrations.sglang import check_derived, identity
from schemas.errors import UserError


def parallel(tp: int, pp: int = 0, attn_tp: int | None = None, attn_dp: int = 0,
             ep: int = 0, attn_dp_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=tp, pp_rank=pp, attn_tp_rank=tp if attn_tp is None
                           else attn_tp, attn_dp_rank=attn_dp, moe_ep_rank=ep,
                           attn_dp_size=attn_dp_size)


def test_identity_from_sglang_parallel_state() -> None:
    # DP attention (attention DP 2): dp is SGLang's attention DP rank
    ident = identity(replica=1, parallel=parallel(3, attn_tp=1, attn_dp=1, ep=3,
                                                  attn_dp_size=2))
    assert ident == {"framework": "sglang", "replica": 1, "dp": 1, "tp": 3, "pp": 0,
                     "ep": 3, "attn_tp": 1}
    # separate DP engines: dp is the engine's DP index
    assert identity(0, dp_rank=1, parallel=parallel(0))["dp"] == 1


def test_derived_entries_are_checked_against_the_model() -> None:
    entry = {"rule": "mla_split", "engine": "sglang", "module": "attn",
             "reads": ["attn.kv_b_proj.weight"], "writes": ["w_kc", "w_vc"]}
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.w_kc = torch.zeros(2)
    with pytest.raises(UserError, match=r"derived: \['attn.w_vc'\] not found"):
        check_derived(model, [entry])
    model.attn.w_vc = torch.zeros(2)
    check_derived(model, [entry])
