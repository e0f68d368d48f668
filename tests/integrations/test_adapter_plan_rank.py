"""The engine adapters find their plan rank by the identity the plan records
(`schemas.identity.find_rank`), not by recomputing the layout's rank order: every engine
rank, named in the engine's own terms, lands on the plan rank its engine's convention gives;
an identity the plan does not hold is refused naming it. Real compiled plan headers; no
vLLM or SGLang process (`integrations/vllm_checks.py`, `integrations/sglang.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from integrations import sglang, vllm_checks
from planner.compiler import compile_config
from planner.spec import spec_from_hf
from schemas.config_load import config_from_dict
from schemas.errors import IdentityError
from schemas.header import PlanHeader
from schemas.identity import find_rank
from tests.support.models import qwen3, qwen3_moe

SOURCE = {"framework": "fsdp2", "dp": 2}


def _header(hf: dict, target: dict) -> PlanHeader:
    cfg = config_from_dict({"model": {"config": "x"}, "source": SOURCE, "target": target})
    return compile_config(cfg, spec_from_hf(hf)).header


def _vllm_worker(t: dict, dp_index: int, p: int, tp: int) -> dict[str, int | str]:
    """What `worker_identity` (+ `check_experts`' ep) reads from a vLLM worker: vLLM's global
    DP index (replica * dp + dp rank), its TP/PP group ranks and its EP rank."""
    dp = t.get("dp", 1)
    world = t["tp"] * t.get("pp", 1)
    return {"framework": "vllm", "index": dp_index * world + p * t["tp"] + tp, "replica": 0,
            "dp": dp_index, "tp": tp, "pp": p,
            "ep": (dp_index % dp) * t["tp"] + tp if t.get("ep") else 0,
            "tp_size": t["tp"], "pp_size": t.get("pp", 1)}


@pytest.mark.parametrize("hf, target", [
    (qwen3(num_hidden_layers=2), {"engine": "vllm", "tp": 2, "pp": 2, "replicas": 2}),
    (qwen3_moe(num_hidden_layers=2), {"engine": "vllm", "tp": 2, "dp": 2, "ep": True,
                                      "replicas": 2}),
])
def test_vllm_worker_finds_the_plan_rank_of_its_global_index(hf: dict, target: dict) -> None:
    header = _header(hf, target)
    found = []
    for dp_index in range(target.get("dp", 1) * target["replicas"]):
        for p in range(target.get("pp", 1)):
            for tp in range(target["tp"]):
                worker = _vllm_worker(target, dp_index, p, tp)
                rank = vllm_checks.find_plan_rank(header, worker)
                # vLLM's worker index (DP x PP x TP, TP fastest) is the target rank
                assert rank == header.sources + worker["index"]
                assert header.identities[rank] == vllm_checks.plan_identity(header, worker)
                found.append(rank)
    assert sorted(found) == list(range(header.sources, header.world))


def test_vllm_worker_the_plan_does_not_hold_is_refused_naming_it() -> None:
    target = {"engine": "vllm", "tp": 2, "replicas": 2}
    header = _header(qwen3(num_hidden_layers=2), target)
    extra = _vllm_worker(target, 2, 0, 1)  # a third engine
    with pytest.raises(IdentityError, match=r"no target rank has the identity vllm "
                       r"replica=2 dp=0 tp=1 pp=0 ep=0; the plan was compiled for target"):
        vllm_checks.find_plan_rank(header, extra)
    wide = {**_vllm_worker(target, 0, 0, 1), "tp_size": 4}  # coordinates fit, sizes do not
    with pytest.raises(vllm_checks.EngineMismatchError, match=r"tp_size 4 \(plan 2\)"):
        vllm_checks.find_plan_rank(header, wide)


def _sglang_parallel(tp: int, tp_size: int, attn_dp: int, ep: bool, pp: int = 0
                     ) -> SimpleNamespace:
    """SGLang's `get_parallel()` for TP rank `tp`: attention TP groups of tp/attn_dp ranks."""
    a = tp_size // attn_dp
    return SimpleNamespace(tp_rank=tp, pp_rank=pp, attn_tp_rank=tp % a, attn_dp_rank=tp // a,
                           attn_dp_size=attn_dp, moe_ep_rank=tp if ep else 0)


def test_sglang_rank_finds_its_plan_rank_in_layout_order() -> None:
    # separate DP engines (dp 2 engines x pp 2 x tp 2), 2 replicas
    header = _header(qwen3(num_hidden_layers=2), {"engine": "sglang", "tp": 2, "pp": 2,
                                                   "dp": 2, "replicas": 2})
    seen = []
    for replica in range(2):
        for engine in range(2):
            for p in range(2):
                for tp in range(2):
                    ident = sglang.identity(replica, engine,
                                            _sglang_parallel(tp, 2, 1, False, p))
                    rank = find_rank(header, ident)
                    assert rank == header.sources + replica * 8 + (engine * 2 + p) * 2 + tp
                    seen.append(rank)
    assert sorted(seen) == list(range(header.sources, header.world))
    # DP attention with EP: one engine of tp ranks, attention DP 2
    header = _header(qwen3_moe(num_hidden_layers=2), {"engine": "sglang", "tp": 4, "dp": 2,
                                                      "dp_attention": True, "ep": True})
    for tp in range(4):
        ident = sglang.identity(0, 0, _sglang_parallel(tp, 4, 2, True))
        assert find_rank(header, ident) == header.sources + tp


def test_sglang_rank_the_plan_does_not_hold_is_refused_naming_it() -> None:
    header = _header(qwen3(num_hidden_layers=2), {"engine": "sglang", "tp": 2, "dp": 2})
    with pytest.raises(IdentityError, match=r"^p.rplan: no target rank has the identity "
                       r"sglang replica=0 dp=2 tp=0 pp=0 ep=0 attn_tp=0; the plan was compiled "
                       r"for target \{'engine': 'sglang'"):
        find_rank(header, sglang.identity(0, dp_rank=2,
                                          parallel=_sglang_parallel(0, 2, 1, False)),
                  "p.rplan")
    with pytest.raises(IdentityError, match=r"identity sglang replica=1 dp=0 "):
        find_rank(header, sglang.identity(1, parallel=_sglang_parallel(0, 2, 1, False)))
