"""integrations/sglang.py against a real SGLang 0.5.23 engine on CPU.

A trainer process (one FSDP2 rank) updates a DeepSeek-V3-shaped (MLA + MoE) SGLang engine
of TP 2 in bf16 over NIXL, four times with new weights; each engine rank drives the update
through SGLang's own `WeightUpdater.begin_weight_update`/`end_weight_update` and checks
(tests/oracles/sglang_update_worker.py): after every complete update every parameter and
the derived `w_kc`/`w_vc` equal SGLang's own reference (a model that loaded the same
checkpoint through SGLang's loader) bit-exactly; before `end` the derived tensors are
stale; every `data_ptr` is unchanged over all updates; in update 3 the trainer never
sends, and `end` refuses the torn update with the version unchanged; update 4 is whole.
"""

from __future__ import annotations

import json

import pytest
import yaml

from planner.compiler import compile_file
from schemas.chunked_plan import starts_chunked
from tests.oracles.launch import free_port, launch
from tests.support import oracles
from tests.support.sglang_models import deepseek_v3

CHUNK_BUDGET = 1 << 18
"""Four chunks of the tiny DeepSeek-V3 on each SGLang TP rank (its largest tensor: 144 KiB)."""

pytestmark = [pytest.mark.oracle, pytest.mark.extended]
pytest.importorskip("nixl")
oracles.require("sglang")


def compiled(tmp_path, **target) -> tuple[dict, str]:
    hf = deepseek_v3(torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = {"model": {"config": "config.json"},
              "source": {"framework": "fsdp2", "dp": 1, "dtype": "bfloat16"},
              "target": {"engine": "sglang", "tp": 2, "dtype": "bfloat16", **target},
              "cluster": {"placement": "colocated", "hosts": 1, "gpus_per_host": 3,
                          "nics_per_host": 1, "source_gpus_per_host": 1}}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    plan = str(tmp_path / "plan.rplan")
    compile_file(str(tmp_path / "plan.yaml"), plan)
    return hf, plan


def test_update_live_engine_bit_exact_with_derived_refresh(tmp_path) -> None:
    hf, plan = compiled(tmp_path)
    launch("sglang_update_worker.py", 3,
           {"config": str(tmp_path / "plan.yaml"), "plan": plan, "hf": hf,
            "store": free_port(), "steps": 4, "torn": 3, "world": 3}, quiet_s=120.0)


@pytest.mark.parametrize("bind", ["rpc", "env"])
def test_update_through_sglang_scheduler_calls(tmp_path, bind: str) -> None:
    """The plugin (integrations/sglang_engine.py) in SGLang's own scheduler handlers:
    rdma_plan_init by RPC or by RDMA_PLAN_SGLANG at the first begin, begin refused until
    paused, four updates through pause /
    begin / end / update_weight_version / continue_generation, bit-exact after each whole
    one; the torn one refused at end_weight_update on every rank, after which the version
    and the pause stay as they were; the next one re-arms the open session. With the RPC
    binding, after step 1 every rank switches to a plan B by the plugin's
    `rdma_plan_switch` (checked on every TP rank first, memory registered once), steps 2-4
    run through it bit for bit, and plan A sent again as version 1 is refused on every rank
    as stale (tests/oracles/sglang_engine_worker.py says which parts of SGLang are real)."""
    hf, plan = compiled(tmp_path)
    launch("sglang_engine_worker.py", 3,
           {"config": str(tmp_path / "plan.yaml"), "plan": plan, "hf": hf,
            "store": free_port(), "ctl": free_port(), "steps": 4, "torn": 3, "world": 3,
            "bind": bind, "chunked": False,
            "switch": 1 if bind == "rpc" else 0}, quiet_s=120.0)


def test_a_chunked_plan_through_sglang_scheduler_calls(tmp_path) -> None:
    """The same plugin and scheduler handlers with a chunked plan (a 256 KiB buffer, four
    chunks on each rank): the engine core receives it chunk by chunk, each switched into
    the live parameters before the next lands, bit-exact with derived refresh after each
    whole update; in the torn one the trainer sends chunk 0 only: end_weight_update is
    refused on every rank naming chunk 1 and the chunks switched, chunk 0's parameters hold
    the new weights and every later chunk's the last whole version's, the version and the
    pause stay; the next update starts again at chunk 0 and is whole."""
    hf, plan = compiled(tmp_path, shadow={"budget_bytes": CHUNK_BUDGET})
    with open(plan, "rb") as f:
        assert starts_chunked(f)
    launch("sglang_engine_worker.py", 3,
           {"config": str(tmp_path / "plan.yaml"), "plan": plan, "hf": hf,
            "store": free_port(), "ctl": free_port(), "steps": 3, "torn": 2, "world": 3,
            "bind": "rpc", "chunked": True, "switch": 0}, quiet_s=120.0)
