"""Traced vLLM layouts without vLLM: when the trace is used, and the on-disk cache (a hit
needs no torch; a cache file is untrusted input: corrupt or out-of-bounds ones are misses).

The cache files here are written from the hand-written layout (what a trace of a covered
family equals, `tests/oracles/test_vllm_trace.py`), so these tests run without vLLM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest

from planner.layouts import traced, vllm
from planner.layouts.base import Piece
from planner.spec import spec_from_hf
from schemas.config import ConfigError, TargetConfig
from tests.support.models import qwen3, qwen3_moe

HF = qwen3_moe(num_hidden_layers=2)
SPEC = spec_from_hf(HF, mtp=False)


def target(**kw: object) -> TargetConfig:
    return TargetConfig(**({"engine": "vllm", "tp": 2, "ep": True} | kw))  # type: ignore[arg-type]


def cached(tmp_path: Path, cfg: TargetConfig) -> Path:
    """A cache file holding the hand-written engine for `cfg`."""
    key = traced.cache_key(HF, cfg)
    path = tmp_path / "traced" / f"{key}.msgpack"
    engine = [r.tensors for r in vllm.layout(SPEC, dataclasses.replace(cfg, replicas=1)).ranks]
    traced.write_cache(str(path), key, engine)
    return path


@pytest.fixture
def no_tracer(monkeypatch: pytest.MonkeyPatch) -> list[TargetConfig]:
    """Record trace requests instead of tracing."""
    calls: list[TargetConfig] = []

    def trace(spec: object, hf: object, cfg: TargetConfig) -> list:
        calls.append(cfg)
        raise ConfigError("traced (stub)")

    monkeypatch.setattr(traced, "_trace", trace)
    return calls


def test_auto_traces_only_model_types_without_rules() -> None:
    assert not traced.uses_trace(SPEC, TargetConfig(engine="vllm"))
    assert traced.uses_trace(SPEC, TargetConfig(engine="vllm", layout="traced"))
    other = dataclasses.replace(SPEC, dims=dataclasses.replace(SPEC.dims, model_type="qwen3_next"))
    assert traced.uses_trace(other, TargetConfig(engine="vllm"))
    assert not traced.uses_trace(other, TargetConfig(engine="vllm", layout="rules"))
    assert not traced.uses_trace(other, TargetConfig(engine="sglang"))
    with pytest.raises(ConfigError, match="target.layout: 'traced' is vllm-only"):
        TargetConfig(engine="sglang", layout="traced")  # type: ignore[arg-type]


def test_a_cache_hit_gives_every_replica_the_engine(tmp_path: Path,
                                                    no_tracer: list) -> None:
    cfg = target(replicas=3, layout="traced")
    cached(tmp_path, cfg)
    got = traced.layout(SPEC, cfg, HF, str(tmp_path))
    assert got == vllm.layout(SPEC, cfg) and no_tracer == []


def test_the_key_covers_model_engine_and_parallel_config(no_tracer: list) -> None:
    key = traced.cache_key(HF, target())
    assert key == traced.cache_key(dict(HF), target(replicas=4))  # replicas reuse
    for other in (traced.cache_key(HF | {"hidden_size": 32}, target()),
                  traced.cache_key(HF, target(ep=False)),
                  traced.cache_key(HF, target(dtype="float32")),
                  traced.cache_key(HF, dataclasses.replace(target(), tp=1, dp=2))):
        assert other != key


@pytest.mark.parametrize("damage", ["truncate", "not msgpack", "wrong key", "unknown tensor",
                                    "box outside tensor", "piece outside parameter",
                                    "negative offset", "one rank short"])
def test_a_damaged_cache_is_traced_again(damage: str, tmp_path: Path,
                                         no_tracer: list) -> None:
    cfg = target(layout="traced")
    path = cached(tmp_path, cfg)
    raw = msgpack.unpackb(path.read_bytes())
    qkv = raw["ranks"][0][1]  # [name, shape, dtype, pieces] of qkv_proj
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "not msgpack":
        path.write_bytes(b"\xc1" * 64)
    else:
        if damage == "wrong key":
            raw["key"] = "0" * 32
        elif damage == "unknown tensor":
            qkv[3][0][0] = "model.layers.0.self_attn.nope.weight"
        elif damage == "box outside tensor":
            qkv[3][0][1] = [10**6, 0]
        elif damage == "piece outside parameter":
            qkv[3][0][3] = [qkv[1][0], 0]
        elif damage == "negative offset":
            qkv[3][0][1] = [-1, 0]
        elif damage == "one rank short":
            raw["ranks"].pop()
        path.write_bytes(msgpack.packb(raw))
    with pytest.raises(ConfigError, match="traced \\(stub\\)"):
        traced.layout(SPEC, cfg, HF, str(tmp_path))
    assert len(no_tracer) == 1


def test_the_undamaged_cache_decodes_piece_for_piece(tmp_path: Path) -> None:
    cfg = target()
    path = cached(tmp_path, cfg)
    got = traced.read_cache(str(path), traced.cache_key(HF, cfg), SPEC, cfg.engine_world)
    want = vllm.layout(SPEC, cfg)
    assert got == [r.tensors for r in want.ranks]
    assert isinstance(got[0][0].pieces[0], Piece)


def test_a_cache_file_is_the_msgpack_of_its_map(tmp_path: Path) -> None:
    cfg = target()
    path = cached(tmp_path, cfg)
    rows = [traced.encode_rank(r.tensors)
            for r in vllm.layout(SPEC, dataclasses.replace(cfg, replicas=1)).ranks]
    key = traced.cache_key(HF, cfg)  # written from each rank's packed rows, as one map
    assert path.read_bytes() == msgpack.packb({"format": traced.FORMAT, "key": key,
                                               "ranks": rows})


def test_settings_the_loader_does_not_write_are_refused(tmp_path: Path) -> None:
    spec = spec_from_hf(qwen3(), mtp=False)
    with pytest.raises(ConfigError, match="target.w13_order: 'w3w1' is not what vLLM"):
        traced.layout(spec, TargetConfig(engine="vllm", w13_order="w3w1"), qwen3(),
                      str(tmp_path))


def test_an_unwritable_cache_only_costs_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = target(layout="traced")
    engine = [r.tensors for r in vllm.layout(SPEC, cfg).ranks]
    monkeypatch.setattr(traced, "_trace", lambda spec, hf, c: engine)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # the cache folder cannot be made under a file
    got = traced.layout(SPEC, cfg, HF, str(blocker))
    assert got == vllm.layout(SPEC, cfg)
    assert "traced layout not cached" in capsys.readouterr().err
