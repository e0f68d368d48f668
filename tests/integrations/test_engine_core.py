"""`integrations.engine_core.EngineCore`, the engine side both adapters share, on a compiled
plan (FSDP2 -> SGLang TP 2) with every rank in one process (`local`):

- the plan file is opened once per engine rank (header, then its own part: the executor is
  handed them), and a plan for another engine is refused in one line before anything binds;
- paused: `run_step` writes the live tensors bit for bit; shadow: the live tensors keep
  version N until `switch`, then hold N+1 at the same `data_ptr`s; `commit` records it;
- the update's state is declared in `__init__` (the helpers read and set those fields only).
"""

from __future__ import annotations

import threading

import pytest
import torch

import executor
import schemas.safe_read
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from integrations.engine_core import EngineCore
from integrations.errors import EngineMismatchError
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.plan import STAGING, open_plan, read_header
from schemas.plan_write import write_plan
from tests.support.models import qwen3

HF = qwen3(num_hidden_layers=2)
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


def _all(fns) -> None:
    errors: list[BaseException] = []

    def guarded(fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    ts = [threading.Thread(target=guarded, args=(fn,)) for fn in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _bind(world, monkeypatch, shadow: bool):
    """A source executor and two engine cores on one fabric; opens of plan files counted."""
    path, ids, spec, layouts = world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    opens: list[str] = []
    real = schemas.safe_read.open_regular

    def counted(p, *a, **k):  # every plan file open goes through it (schemas.plan.open_plan)
        opens.append(p)
        return real(p, *a, **k)
    monkeypatch.setattr(schemas.safe_read, "open_regular", counted)
    src, live_n = _versions(spec, layouts, seed=1)
    live = {t: {n: v.clone() for n, v in ts.items()} for t, ts in live_n.items()}
    fabric = Fabric()
    out: dict[str, object] = {}

    out["src_tensors"] = src[0]

    def source() -> None:
        out["src"] = executor.load(path, 0, src[0], transport="local", rendezvous=fabric,
                                   identity=ids[0], timeout_s=20)

    def target(t: int) -> None:
        core = EngineCore(path, "sglang", lambda header, t=t: ids[1 + t])
        out[f"opens{t}"] = len(opens)
        core.load(live[t], shadow=live[t] if shadow else None, transport="local",
                  rendezvous=fabric, timeout_s=20)
        out[t] = core
    _all([source] + [lambda t=t: target(t) for t in (0, 1)])
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
            _all([lambda: executor.run(out["src"])] +
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
        EngineCore(path, "vllm", lambda h: located.append(h) or ids[1])
    assert str(e.value) == (f"{path}: target.engine is 'sglang', not 'vllm'; compile the "
                            "plan with target.engine: vllm")
    assert located == []  # refused before the engine's identity is asked for


def test_the_update_state_is_declared_in_init(world, monkeypatch):
    """Every field the helpers read or set exists before any update."""
    path, ids, _, _ = world
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    core = EngineCore(path, "sglang", lambda h: ids[1])
    assert {"plan", "shadow", "version", "pending", "failure", "received", "torn_open",
            "landed", "wait_s", "derived", "placement"} <= set(vars(core))
    assert core.plan is None and core.version is None
