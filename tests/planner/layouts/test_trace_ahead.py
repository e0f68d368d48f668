"""Tracing ahead (`planner/layouts/trace_ahead.py`): a trace not cached runs in a forked
process begun before the source side is built; its answer is the in-process trace's, is
checked like a cache file and is cached; its failures are one line; leaving early stops it.

`traced._trace` is replaced by a stub (the fork inherits it) giving the hand-written engine
(what a trace of a covered family equals, `tests/oracles/test_vllm_trace.py`), so these
tests run without vLLM; so is the lean import (`vllm_lean.install`: it would import torch in
every tracer), but where a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from planner.fp8 import quantize_layout
from planner.frameworks import build_layout, start_layout
from planner.layouts import trace_ahead, traced, vllm, vllm_lean
from planner.layouts.base import Piece
from planner.spec import spec_from_hf
from schemas.config import ConfigError, TargetConfig
from tests.support.clock import within_guard
from tests.support.models import qwen3_moe

HF = qwen3_moe(num_hidden_layers=2)
SPEC = spec_from_hf(HF, mtp=False)
ROOT_PLANS = Path(__file__).resolve().parents[3] / "plans"
pytestmark = pytest.mark.skipif("fork" not in __import__("multiprocessing")
                                .get_all_start_methods(), reason="tracing ahead forks")


@pytest.fixture(autouse=True)
def no_lean_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_lean, "install", lambda: False)


def target(**kw: object) -> TargetConfig:
    return TargetConfig(**({"engine": "vllm", "tp": 2, "ep": True, "layout": "traced",
                            "replicas": 3} | kw))  # type: ignore[arg-type]


def engine(cfg: TargetConfig) -> list:
    return [r.tensors for r in vllm.layout(SPEC, dataclasses.replace(cfg, replicas=1)).ranks]


def stub(monkeypatch: pytest.MonkeyPatch, trace: Callable[..., list]) -> None:
    """The tracer's trace: `trace`'s engine, encoded as vLLM's tracing workers send it."""
    monkeypatch.setattr(traced, "trace_packed", lambda *a: packed(trace(*a)))


def packed(engine: list) -> list[bytes]:
    """Ranks as the tracer sends them: each rank's `encode_rank` rows, packed."""
    return [msgpack.packb(traced.encode_rank(rank)) for rank in engine]


def test_the_forked_trace_is_the_layout_and_is_cached(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = target()
    stub(monkeypatch, lambda spec, hf, c: [] if c.replicas != 1 else engine(c))
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as pending:
        assert pending._proc is not None  # started before result() is asked for
        got = pending.result()
    assert got == vllm.layout(SPEC, cfg)
    assert pending._proc is None  # reaped
    key = traced.cache_key(HF, cfg)
    cached = traced.read_cache(traced.cache_path(str(tmp_path), key), key, SPEC,
                               cfg.engine_world)
    assert cached == engine(cfg)
    stub(monkeypatch, lambda *a: pytest.fail("traced again although cached"))
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as again:
        assert again._proc is None and again.result() == got


def test_fp8_quantizes_the_traced_engine(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hf = qwen3_moe(hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=256, moe_intermediate_size=256, vocab_size=256)
    spec = spec_from_hf(hf, mtp=False)  # every TP 2 shard 128x128-block aligned
    monkeypatch.setenv("RDMA_PLAN_CACHE", str(tmp_path))
    cfg = target(dtype="fp8_block128")
    calls: list[str] = []

    def trace(spec_: object, hf_: object, c: TargetConfig) -> list:
        calls.append(c.dtype)  # in the forked tracer: this process never sees it
        return [r.tensors for r in vllm.layout(spec, c).ranks]

    stub(monkeypatch, trace)
    with start_layout(spec, cfg, hf) as pending:
        got = pending.result()
    want = quantize_layout(vllm.layout(spec, dataclasses.replace(cfg, dtype="bfloat16")), spec)
    assert got == want
    assert build_layout(spec, cfg, hf) == want  # the cache the tracer wrote: bf16, reused
    assert calls == []


def test_a_refusal_in_the_tracer_is_one_line_here(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object) -> None:
        raise ConfigError("target: vLLM refuses this engine (stub)")

    stub(monkeypatch, refuse)
    with trace_ahead.begin(SPEC, target(), HF, str(tmp_path)) as pending:
        with pytest.raises(ConfigError, match=r"^target: vLLM refuses this engine \(stub\)$"):
            pending.result()
    assert not (tmp_path / "traced").exists()


@pytest.mark.parametrize("fault", ["crash", "dies", "bad piece", "rank short"])
def test_a_failed_or_bad_tracer_is_refused(fault: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def trace(spec: object, hf: object, c: TargetConfig) -> list:
        ranks = engine(c)
        if fault == "crash":
            raise RuntimeError("boom\nsecond line")
        if fault == "dies":
            os._exit(3)
        if fault == "bad piece":
            pt = ranks[0][0]
            bad = dataclasses.replace(pt.pieces[0], offsets=(10**6, 0))
            ranks[0] = (dataclasses.replace(pt, pieces=(bad, *pt.pieces[1:])), *ranks[0][1:])
        return ranks[:-1] if fault == "rank short" else ranks

    stub(monkeypatch, trace)
    want = {"crash": "tracing failed \\(RuntimeError: boom", "dies": "died without an answer",
            "bad piece": "sent a bad answer", "rank short": "sent a bad answer"}[fault]
    with trace_ahead.begin(SPEC, target(), HF, str(tmp_path)) as pending:
        with pytest.raises(ConfigError, match=want):
            pending.result()
    assert pending._proc is None


def test_leaving_early_stops_the_tracer(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*a: object) -> list:
        time.sleep(600)
        return []

    stub(monkeypatch, slow)
    t = time.monotonic()
    with pytest.raises(ValueError, match="the source side failed"):
        with trace_ahead.begin(SPEC, target(), HF, str(tmp_path)) as pending:
            proc = pending._proc
            raise ValueError("the source side failed")
    assert not proc.is_alive()
    within_guard(time.monotonic() - t, 3.0, "stopping the tracer (asleep for 600 s)")


def test_settings_the_loader_does_not_write_are_refused_before_forking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stub(monkeypatch, lambda *a: pytest.fail("traced"))
    with pytest.raises(ConfigError, match="target.w13_order"):
        trace_ahead.begin(SPEC, target(w13_order="w3w1"), HF, str(tmp_path))


def test_layouts_without_a_trace_are_built_on_result() -> None:
    cfg = dataclasses.replace(target(), layout="rules")
    with start_layout(SPEC, cfg, HF) as pending:
        assert pending._proc is None
        got = pending.result()
    assert got == vllm.layout(SPEC, cfg) and isinstance(got.ranks[0].tensors[0].pieces[0],
                                                        Piece)


def lean_stub(monkeypatch: pytest.MonkeyPatch, lean_fails: bool, whole_fails: bool) -> None:
    """A tracer whose `install` says it imported lean (noted in its environment, which a
    tracer forked after it does not share) and whose trace fails lean or whole as told."""
    monkeypatch.delenv("LEAN_TEST", raising=False)
    monkeypatch.setenv("RDMA_PLAN_TRACE_LEAN", "1")  # opt-in
    monkeypatch.setattr(vllm_lean, "install", lambda: os.environ.setdefault("LEAN_TEST", "1"))

    def trace(spec: object, hf: object, c: TargetConfig) -> list:
        lean = os.environ.get("LEAN_TEST") == "1"
        if lean and lean_fails:
            raise vllm_lean.LeanMiss("called vllm.x.Y, left out by the lean import of vLLM")
        if not lean and whole_fails:
            raise ConfigError("target: vLLM refuses this engine (whole)")
        return engine(c)

    stub(monkeypatch, trace)


@pytest.mark.parametrize("lean_fails", [False, True])
def test_a_failed_lean_tracer_is_followed_by_a_whole_one(lean_fails: bool, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    lean_stub(monkeypatch, lean_fails, whole_fails=False)
    forks: list[bool] = []
    fork = trace_ahead._fork
    monkeypatch.setattr(trace_ahead, "_fork", lambda *a: forks.append(a[-1]) or fork(*a))
    cfg = target()
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as pending:
        got = pending.result()
    assert got == vllm.layout(SPEC, cfg)
    assert forks == ([True, False] if lean_fails else [True])
    key = traced.cache_key(HF, cfg)
    assert traced.read_cache(traced.cache_path(str(tmp_path), key), key, SPEC,
                             cfg.engine_world) == engine(cfg)


def test_a_whole_tracer_refusing_too_is_its_one_line(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lean_stub(monkeypatch, lean_fails=True, whole_fails=True)
    with trace_ahead.begin(SPEC, target(), HF, str(tmp_path)) as pending:
        with pytest.raises(ConfigError, match=r"^target: vLLM refuses this engine \(whole\)$"):
            pending.result()
    assert pending._proc is None and not (tmp_path / "traced").exists()


def test_no_lean_import_when_switched_off(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMA_PLAN_TRACE_LEAN", "0")
    forks: list[bool] = []
    fork = trace_ahead._fork
    monkeypatch.setattr(trace_ahead, "_fork", lambda *a: forks.append(a[-1]) or fork(*a))
    stub(monkeypatch, lambda spec, hf, c: engine(c))
    with trace_ahead.begin(SPEC, target(), HF, str(tmp_path)) as pending:
        pending.result()
    assert forks == [False]


def swapped(cfg: TargetConfig) -> list:
    """A valid engine that is not the rules' one: its first two ranks swapped."""
    ranks = engine(cfg)
    return [ranks[1], ranks[0], *ranks[2:]]


@pytest.mark.parametrize("same", [True, False])
def test_the_rules_are_a_guess_the_trace_confirms_or_refutes(
        same: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = target()
    stub(monkeypatch, lambda spec, hf, c: engine(c) if same else swapped(c))
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as pending:
        guess = pending.guess()
        assert guess == vllm.layout(SPEC, cfg) and pending._proc is not None  # not waited
        assert pending.confirms(guess) is same
        got = pending.result()
    assert (got is guess) is same
    want = vllm.layout(SPEC, cfg) if same else trace_ahead._decoded(packed(swapped(cfg)),
                                                                    SPEC, cfg)
    assert got == want and pending._proc is None
    assert pending.confirms(vllm.layout(SPEC, cfg)) is False  # not the object it gave


def test_no_guess_without_rules_a_trace_or_a_layout_the_rules_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stub(monkeypatch, lambda spec, hf, c: engine(c))
    cfg = target()
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as pending:
        pending.result()  # traced and cached
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path)) as hit:
        assert hit.guess() is None  # nothing under way
    monkeypatch.setattr(traced, "HAND_WRITTEN", ())
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path / "b")) as no_rules:
        assert no_rules.guess() is None
    monkeypatch.undo()
    stub(monkeypatch, lambda spec, hf, c: engine(c))
    monkeypatch.setattr(vllm, "layout", lambda *a: (_ for _ in ()).throw(ConfigError("no")))
    with trace_ahead.begin(SPEC, cfg, HF, str(tmp_path / "c")) as refused:
        assert refused.guess() is None and refused.confirms(cfg) is False  # type: ignore[arg-type]


def test_a_guess_of_fp8_is_the_quantized_rules(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hf = qwen3_moe(hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=256, moe_intermediate_size=256, vocab_size=256)
    spec = spec_from_hf(hf, mtp=False)
    monkeypatch.setenv("RDMA_PLAN_CACHE", str(tmp_path))
    cfg = target(dtype="fp8_block128")
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    stub(monkeypatch, lambda s, h, c: [r.tensors for r in vllm.layout(spec, c).ranks])
    with start_layout(spec, cfg, hf) as pending:
        guess = pending.guess()
        assert guess == quantize_layout(vllm.layout(spec, bf16), spec)
        assert pending.confirms(guess) and pending.result() is guess


@pytest.mark.parametrize("same", [True, False])
def test_a_compile_keeps_the_guessed_plan_only_if_the_trace_confirms_it(
        same: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.compiler import compile_config, compile_layouts
    from planner.validate import load
    from schemas.plan_write import encode_plan

    monkeypatch.setenv("RDMA_PLAN_CACHE", str(tmp_path))
    conf = tmp_path / "c.yaml"
    text = (ROOT_PLANS / "demo-moe.yaml").read_text()
    conf.write_text(text.replace("config: models/", f"config: {ROOT_PLANS}/models/")
                    .replace("ep: true}", "ep: true, layout: traced}"))
    cfg, spec = load(str(conf))
    stub(monkeypatch, lambda s, h, c: engine_of(s, c) if same else swapped_of(s, c))
    guessed: list[bool] = []
    confirms = trace_ahead.Pending.confirms
    monkeypatch.setattr(trace_ahead.Pending, "confirms",
                        lambda self, g: guessed.append(confirms(self, g)) or guessed[-1])
    seen: list[bytes] = []
    got = encode_plan(compile_config(cfg, spec, on_plan=lambda p: seen.append(encode_plan(p))))
    assert guessed == [same]
    assert seen[-1] == got and len(seen) == (1 if same else 2)  # a refuted guess's plan first
    dst = trace_ahead._decoded(packed(
        engine_of(spec, cfg.target) if same else swapped_of(spec, cfg.target)), spec, cfg.target)
    src = build_layout(spec, cfg.source)
    assert got == encode_plan(compile_layouts(cfg, spec, src, dst))  # the traced layout's plan
    rules = build_layout(spec, dataclasses.replace(cfg.target, layout="rules"))
    assert (got == encode_plan(compile_layouts(cfg, spec, src, rules))) is same



def engine_of(spec: object, c: TargetConfig) -> list:
    return [r.tensors for r in vllm.layout(spec, dataclasses.replace(c, replicas=1)).ranks]


def swapped_of(spec: object, c: TargetConfig) -> list:
    ranks = engine_of(spec, c)
    return [ranks[1], ranks[0], *ranks[2:]]
