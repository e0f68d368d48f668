"""The pieces the live checks stand on, without an engine:

- `harness.weights.assemble` inverts `materialize` (a trainer's shards under its source
  layout back to full logical tensors; what the RL loop's `expected_digests` does), and
  `layout_digests` moves with every byte: one element changed in a full tensor changes the
  digest of exactly the target ranks that hold it.
- One `TornUpdateError` (`integrations.errors`), raised by vLLM's backend and SGLang's
  plugin alike, an `executor.TornUpdateError`.
- `integrations.sglang_trainer.update` reports an end refused for an unflushed cache as
  `CacheNotFlushedError` (weights whole, not torn) and a torn end as `TornUpdateError`;
  the live engine case is tests/integrations/test_sglang_live.py (deep).
"""

from __future__ import annotations

import pytest
import torch

import executor
from harness.weights import (
    assemble,
    layout_digests,
    materialize,
    random_full_tensors,
)
from integrations import tensor_sha256
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from schemas.config import SourceConfig, TargetConfig
from tests.support import engine_models

HF = engine_models.qwen3(num_hidden_layers=2)


@pytest.mark.parametrize("source", [SourceConfig(framework="fsdp2", dp=2, dtype="float32"),
                                    SourceConfig(framework="megatron", tp=2,
                                                 dtype="float32")],
                         ids=["fsdp2-dp2", "megatron-tp2"])
def test_assemble_inverts_materialize_and_digests_follow_every_byte(source) -> None:  # noqa: ANN001
    spec = spec_from_hf(HF, mtp=False)
    full = random_full_tensors(spec, seed=5)
    parts = materialize(build_layout(spec, source, HF), full)
    back = assemble(build_layout(spec, source, HF), parts,
                    {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in spec.tensors})
    assert all(torch.equal(back[n], full[n]) for n in full)

    target = build_layout(spec, TargetConfig(engine="sglang", tp=2, dtype="float32"), HF)
    want = layout_digests(target, full)
    built = materialize(target, full)
    assert want == {r: {n: tensor_sha256(t) for n, t in ts.items()} for r, ts in built.items()}
    name = "model.layers.1.self_attn.o_proj.weight"  # row-parallel: column 0 is on rank 0
    full[name][0, 0] += 1.0
    moved = layout_digests(target, full)
    changed = {(r, n) for r in want for n in want[r] if want[r][n] != moved[r][n]}
    assert changed == {(0, name)}, changed


def test_one_torn_update_hierarchy() -> None:
    from integrations import errors, sglang, sglang_shadow, sglang_trainer

    modules = [sglang, sglang_shadow, sglang_trainer]
    vllm = pytest.importorskip("integrations.vllm")
    modules += [vllm, pytest.importorskip("integrations.vllm_shadow"),
                pytest.importorskip("integrations.vllm_torn")]
    for mod in modules:  # the one class, raised everywhere
        assert mod.TornUpdateError is errors.TornUpdateError, mod.__name__
    with pytest.raises(executor.TornUpdateError):
        raise errors.TornUpdateError("torn")
    assert not issubclass(errors.CacheNotFlushedError, executor.TornUpdateError)


def scripted(end: dict) -> tuple[list[str], object]:
    """SGLang's answers to `update`'s posts, the end one given (records the endpoints)."""
    posted: list[str] = []

    def call(endpoint: str, body: dict) -> dict:
        posted.append(endpoint)
        return end if endpoint == "end_weight_update" else {"success": True, "message": ""}
    return posted, call


def test_update_names_an_unflushed_cache_and_a_torn_end_apart() -> None:
    from integrations.errors import CacheNotFlushedError
    from integrations.sglang_trainer import NOT_FLUSHED, update

    posted, call = scripted({"success": False, "message": f"{NOT_FLUSHED}: requests run"})
    with pytest.raises(CacheNotFlushedError, match="'v7' was not committed") as e:
        update(call, lambda: None, "v7")
    assert not isinstance(e.value, executor.TornUpdateError) and e.value.version == "v7"
    assert "finish_unflushed" in str(e.value) and "retract" in str(e.value)
    assert posted == ["pause_generation", "begin_weight_update", "end_weight_update"]

    posted, call = scripted({"success": False, "message": "rdma-plan: plan rank(s) [1] torn"})
    with pytest.raises(executor.TornUpdateError, match="plan rank"):
        update(call, lambda: None, "v8")
