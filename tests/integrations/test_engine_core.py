"""`integrations.engine_core.EngineCore`, the engine side both adapters share, on a compiled
plan (FSDP2 -> SGLang TP 2) with every rank in one process (`local`):

- the plan file is opened once per engine rank (header, then its own part: the executor is
  handed them), and a plan for another engine is refused in one line before anything binds;
- paused: `run_step` writes the live tensors bit for bit; shadow: the live tensors keep
  version N until `switch`, then hold N+1 at the same `data_ptr`s; `commit` records it;
- the update's state is declared in `__init__` (the helpers read and set those fields only);
- chunked: the same pair compiled by `compile_to` as a chunked plan is read once per engine
  rank (index, every chunk's header and part), received chunk by chunk into the live
  tensors bit for bit, a chunk that never lands tears the update naming the mix, and the
  shadow mode is refused for it (by the core, and by vLLM's trainer engine before the
  workers load). These tests drive the core with the real executor (`local` transport); the
  live engines receive a chunked plan in `test_sglang_update.py` and `test_vllm_engine.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import executor
import schemas.safe_read
from executor.chunked import load_chunks, run_chunks
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from integrations.engine_core import EngineCore
from integrations.errors import EngineMismatchError
from planner.compiler import compile_config, compile_to
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.chunked_plan import load_chunked
from schemas.config_load import config_from_dict
from schemas.plan import STAGING, open_plan, read_header
from schemas.plan_write import write_plan
from tests.support.models import qwen3
from tests.support.threads import together

HF = qwen3(num_hidden_layers=2)


def no_eplb(plan: object) -> None:
    """The engine's expert placement: none (a dense model)."""
    return None
SOURCE = {"framework": "fsdp2", "dp": 1, "dtype": "float32"}
TARGET = {"engine": "sglang", "tp": 2, "dtype": "float32"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    spec = spec_from_hf(HF)
    cfg = config_from_dict({"model": {"config": "x"}, "source": SOURCE, "target": TARGET})
    validate(cfg, spec)
    path = str(tmp_path_factory.mktemp("core") / "p.rplan")
    write_plan(path, compile_config(cfg, spec))
    with open_plan(path) as f:
        ids = list(read_header(f, path)[0].identities)
    layouts = [build_layout(spec, c, HF) for c in (cfg.source, cfg.target)]
    return path, ids, spec, layouts


def _versions(spec, layouts, seed: int):
    full = random_full_tensors(spec, seed=seed)
    src = materialize(layouts[0], full)
    want = materialize(layouts[1], full)  # by target rank
    return src, want


def _count_opens(monkeypatch) -> list[str]:
    """The paths of plan files opened from now on (no job secret set)."""
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    opens: list[str] = []
    real = schemas.safe_read.open_regular

    def counted(p, *a, **k):  # every plan file open goes through it (schemas.plan.open_plan)
        opens.append(p)
        return real(p, *a, **k)
    monkeypatch.setattr(schemas.safe_read, "open_regular", counted)
    return opens


def _bind(world, monkeypatch, shadow: bool):
    """A source executor and two engine cores on one fabric; opens of plan files counted."""
    path, ids, spec, layouts = world
    opens = _count_opens(monkeypatch)
    src, live_n = _versions(spec, layouts, seed=1)
    live = {t: {n: v.clone() for n, v in ts.items()} for t, ts in live_n.items()}
    fabric = Fabric()
    out: dict[str, object] = {}

    out["src_tensors"] = src[0]

    def source() -> None:
        out["src"] = executor.load(path, 0, src[0], transport="local", rendezvous=fabric,
                                   identity=ids[0], timeout_s=20)

    def target(t: int) -> None:
        core = EngineCore(path, "sglang", lambda header, t=t: ids[1 + t], placement=no_eplb)
        out[f"opens{t}"] = len(opens)
        core.load(live[t], shadow=live[t] if shadow else None, transport="local",
                  rendezvous=fabric, timeout_s=20)
        out[t] = core
    together([source] + [lambda t=t: target(t) for t in (0, 1)])
    return out, live, opens


def test_the_plan_file_is_opened_once_per_engine_rank(world, monkeypatch):
    out, _, opens = _bind(world, monkeypatch, shadow=False)
    try:
        path = world[0]
        # 1 for the source's executor.load, 1 per engine rank (header and part together)
        assert opens == [path] * 3, opens
        for t in (0, 1):
            core = out[t]
            assert core.rank == 1 + t and core.identity == world[1][1 + t]
            assert core.written() == [r.name for r in core.part.regions if r.name != STAGING]
    finally:
        for k in ("src", 0, 1):
            out[k].close()


@pytest.mark.parametrize("shadow", [False, True], ids=["paused", "shadow"])
def test_paused_and_shadow_receive_write_every_byte(world, monkeypatch, shadow):
    out, live, _ = _bind(world, monkeypatch, shadow)
    path, ids, spec, layouts = world
    try:
        src, want = _versions(spec, layouts, seed=2)
        for name, t in src[0].items():  # version N+1 into the source's bound tensors
            out["src_tensors"][name].copy_(t)
        cores = [out[0], out[1]]
        for c in cores:
            c.begin("v2")
        ptrs = {t: {n: v.data_ptr() for n, v in live[t].items()} for t in (0, 1)}
        before = {t: {n: v.clone() for n, v in live[t].items()} for t in (0, 1)}
        if shadow:
            for c in cores:
                c.start()
            executor.run(out["src"])
            assert all(c.wait(20) is None for c in cores)
            for t in (0, 1):  # nothing switched yet: version N serves
                assert all(torch.equal(live[t][n], before[t][n]) for n in live[t])
            for c in cores:
                c.switch()
        else:
            ok: dict[int, bool] = {}
            together([lambda: executor.run(out["src"])] +
                 [lambda t=t: ok.__setitem__(t, cores[t].run_step()) for t in (0, 1)])
            assert ok == {0: True, 1: True}
        for t, c in enumerate(cores):
            c.commit("v2")
            assert c.version == "v2" and c.failure is None
            for n, v in want[t].items():
                assert torch.equal(live[t][n], v), (shadow, t, n)
                assert live[t][n].data_ptr() == ptrs[t][n]
            assert any(not torch.equal(live[t][n], before[t][n]) for n in live[t])
    finally:
        for k in ("src", 0, 1):
            out[k].close()


def test_a_plan_for_another_engine_is_refused_before_anything_binds(world, monkeypatch):
    path, ids, _, _ = world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    located = []
    with pytest.raises(EngineMismatchError) as e:
        EngineCore(path, "vllm", lambda h: located.append(h) or ids[1], placement=no_eplb)
    assert str(e.value) == (f"{path}: target.engine is 'sglang', not 'vllm'; compile the "
                            "plan with target.engine: vllm")
    assert located == []  # refused before the engine's identity is asked for


def test_the_update_state_is_declared_in_init(world, monkeypatch):
    """Every field the helpers read or set exists before any update."""
    path, ids, _, _ = world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    core = EngineCore(path, "sglang", lambda h: ids[1], placement=no_eplb)
    assert {"plan", "shadow", "version", "pending", "failure", "received", "torn_open",
            "landed", "wait_s", "derived", "placement"} <= set(vars(core))
    assert core.plan is None and core.version is None


def test_begin_refuses_an_engine_whose_experts_moved_and_changes_nothing(world, monkeypatch):
    """Every update begins with the engine's expert placement (the adapter's reader) against
    the plan's: an engine whose experts were moved refuses a plan for the default placement
    in one line, the open update's state untouched; the engine's default placement passes."""
    from integrations.errors import PlacementMismatchError
    from schemas.placement import Placement

    path, ids, _, _ = world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    engine = {"placement": Placement(np.array([[0, 1, 2, 3]]))}  # the default
    core = EngineCore(path, "sglang", lambda h: ids[1], placement=lambda _: engine["placement"])
    core.begin("v1")
    core.failure = RuntimeError("torn")
    engine["placement"] = Placement(np.array([[1, 0, 2, 3]]))  # slots 0 and 1 swapped
    with pytest.raises(PlacementMismatchError) as e:
        core.begin("v2")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"sglang target ({path}): ")
    assert "MoE layer 0 physical expert 0 holds logical expert 1" in line, line
    assert core.pending == "v1" and str(core.failure) == "torn"  # nothing changed
    engine["placement"] = Placement(np.array([[0, 1, 2, 3]]))
    core.begin("v2")
    assert core.pending == "v2" and core.failure is None


# ---------------------------------------------------------------- chunked mode
BUDGET = 8192
"""The chunked plan's buffer: a few of the tiny model's tensors at a time."""


@pytest.fixture(scope="module")
def chunked_world(tmp_path_factory):
    """The same FSDP2 -> SGLang TP 2 pair compiled by `compile_to` as a chunked plan."""
    spec = spec_from_hf(HF)
    cfg = config_from_dict({"model": {"config": "x"}, "source": SOURCE,
                            "target": dict(TARGET, shadow={"budget_bytes": BUDGET})})
    validate(cfg, spec)
    path = str(tmp_path_factory.mktemp("chunked") / "p.rplan")
    stats = compile_to(cfg, spec, path)
    _, plans = load_chunked(path)
    ids = list(plans[0].header.identities)
    layouts = [build_layout(spec, c, HF) for c in (cfg.source, cfg.target)]
    return path, ids, spec, layouts, stats["chunks"]


def _bind_chunked(chunked_world, monkeypatch, timeout_s: float = 20):
    """A source's chunk executors and two engine cores in chunked mode on one fabric."""
    path, ids, spec, layouts, _ = chunked_world
    opens = _count_opens(monkeypatch)
    src, live_n = _versions(spec, layouts, seed=1)
    live = {t: {n: v.clone() for n, v in ts.items()} for t, ts in live_n.items()}
    fabric = Fabric()
    out: dict[object, object] = {"src_tensors": src[0]}

    def source() -> None:
        out["src"] = load_chunks(path, 0, src[0], transport="local", rendezvous=fabric,
                                 identity=ids[0], timeout_s=timeout_s)

    def target(t: int) -> None:
        core = EngineCore(path, "sglang", lambda header, t=t: ids[1 + t], placement=no_eplb)
        core.load(live[t], transport="local", rendezvous=fabric, timeout_s=timeout_s)
        out[t] = core
    together([source] + [lambda t=t: target(t) for t in (0, 1)])
    return out, live, opens


def _close_chunked(out) -> None:
    for ex in out.get("src", []):
        ex.close()
    for t in (0, 1):
        if t in out:
            out[t].close()


def test_a_chunked_plan_is_read_once_and_received_chunk_by_chunk(chunked_world, monkeypatch):
    path, ids, spec, layouts, chunks = chunked_world
    out, live, opens = _bind_chunked(chunked_world, monkeypatch)
    try:
        # 1 for the source's load_chunks, 1 per engine rank (index, headers and parts)
        assert opens == [path] * 3, opens
        cores = [out[0], out[1]]
        for t, c in enumerate(cores):
            assert c.budget == BUDGET and len(c.parts) == chunks >= 3
            assert c.rank == 1 + t and c.identity == ids[1 + t]
            assert c.chunked is not None and c.plan is None and c.shadow is None
            assert sorted(c.written()) == sorted(live[t])  # every tensor in one chunk
            with pytest.raises(ValueError, match="one part per chunk"):
                c.part  # noqa: B018 - the property refuses
        src, want = _versions(spec, layouts, seed=2)
        for name, v in src[0].items():  # version N+1 into the source's bound tensors
            out["src_tensors"][name].copy_(v)
        ptrs = {t: {n: v.data_ptr() for n, v in live[t].items()} for t in (0, 1)}
        before = {t: {n: v.clone() for n, v in live[t].items()} for t in (0, 1)}
        ok: dict[int, bool] = {}
        for c in cores:
            c.begin("v2")
        together([lambda: run_chunks(out["src"])] +
             [lambda t=t: ok.__setitem__(t, cores[t].run_step()) for t in (0, 1)])
        assert ok == {0: True, 1: True}, [c.failure for c in cores]
        for t, c in enumerate(cores):
            c.commit("v2")
            assert c.version == "v2" and c.failure is None and c.chunked.switched == chunks
            for n, v in want[t].items():
                assert torch.equal(live[t][n], v), (t, n)
                assert live[t][n].data_ptr() == ptrs[t][n]
            assert any(not torch.equal(live[t][n], before[t][n]) for n in live[t])
    finally:
        _close_chunked(out)


def test_a_chunk_that_never_lands_tears_the_update_with_the_mix_named(chunked_world,
                                                                      monkeypatch):
    """The source sends chunk 0 only: each core's `run_step` fails at chunk 1, chunk 0
    switched (version N+1) and the others kept (version N), and `failure` says so."""
    out, live, _ = _bind_chunked(chunked_world, monkeypatch, timeout_s=3)
    try:
        cores = [out[0], out[1]]
        ok: dict[int, bool] = {}
        for c in cores:
            c.begin("v2")
        together([lambda: out["src"][0].run()] +
             [lambda t=t: ok.__setitem__(t, cores[t].run_step()) for t in (0, 1)])
        assert ok == {0: False, 1: False}
        for c in cores:
            assert isinstance(c.failure, executor.TornUpdateError), c.failure
            assert "chunk 1 of" in str(c.failure) and "chunks 0..0 were switched" in str(
                c.failure)
            assert c.chunked.switched == 1 and c.version is None
    finally:
        _close_chunked(out)


def test_a_chunked_plan_is_refused_in_shadow_mode_before_anything_binds(chunked_world,
                                                                       monkeypatch):
    path, ids, *_ = chunked_world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    core = EngineCore(path, "sglang", lambda h: ids[1], placement=no_eplb)
    with pytest.raises(ValueError) as e:
        core.load({}, shadow={})
    assert str(e.value) == (f"{path}: a chunked plan streams through its own {BUDGET}-byte "
                            "buffer: load it without a shadow and receive it paused "
                            "(run_step), or compile with target.shadow: full for the shadow "
                            "mode")
    assert core.chunked is None and core.plan is None


def test_the_vllm_trainer_refuses_a_chunked_plan_in_shadow_mode_before_the_workers_load(
        chunked_world, monkeypatch):
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    from integrations.vllm import RdmaPlanTrainerEngine, RdmaPlanTrainerInitInfo
    from tests.support.integration import RecordingClient

    path, *_ = chunked_world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    client = RecordingClient()
    info = RdmaPlanTrainerInitInfo(path, "127.0.0.1:1", rank=0, plan_rank=0, no_identity=True,
                                   shadow=True)
    with pytest.raises(ValueError) as e:
        RdmaPlanTrainerEngine.trainer_init(info, client=client)
    assert str(e.value) == (f"{info.where()}: {path} is a chunked plan, received paused: drop "
                            "shadow=True, or compile with target.shadow: full for the shadow "
                            "mode")
    assert client.calls == []
