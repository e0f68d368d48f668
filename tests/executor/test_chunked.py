"""Chunked shadow (`executor/chunked.py`): the refit streams through one buffer of N bytes,
chunk by chunk (whole target tensors, layer by layer), each chunk switched into the live
tensors before the next lands. Compiled plans of the tiny Qwen3 and the tiny gpt-oss
(UNPACKs on the targets), every rank in one process (`local`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from executor import TornUpdateError
from executor.chunked import run_chunks
from schemas.chunked_plan import load_chunked
from schemas.config import ConfigError
from tests.support.chunked_world import BUDGET, World, as_bytes, padding_only
from tests.support.shadow_plans import CASES, compile_chunked_file


def _threads(fns: dict[int, object]) -> tuple[dict[int, object], dict[int, BaseException]]:
    res: dict[int, object] = {}
    errs: dict[int, BaseException] = {}

    def go(r, fn):
        try:
            res[r] = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at them
            errs[r] = e
    ts = [threading.Thread(target=go, args=(r, f)) for r, f in fns.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    return res, errs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunked_refit_is_bit_exact_in_place_chunk_by_chunk_within_the_budget(case, tmp_path):
    path = str(tmp_path / "p.rplan")
    plans = compile_chunked_file(case, BUDGET, path)
    budget, loaded = load_chunked(path)
    assert budget == BUDGET and len(loaded) == len(plans) >= 3
    w = World(case, path)
    ptrs = {(r, k): v.data_ptr() for r, t in w.live.items() for k, v in t.items()}
    fns = {r: (lambda c=c: run_chunks(c, 1)) for r, c in w.sources.items()}
    fns.update({r: (lambda s=s: s.run(1)) for r, s in w.targets.items()})
    res, errs = _threads(fns)
    assert not errs, errs
    for r, s in w.targets.items():
        st = res[r]
        assert st.version == 1 and len(st.switch_s) == len(plans) and s.switched == len(plans)
        assert s.extra_bytes == BUDGET == s.buffer.numel()
        # every chunk landed at most N bytes on the rank
        for p in plans:
            rp = p.ranks[r]
            assert sum(g.nbytes for g in rp.regions if g.name != "__staging__") <= BUDGET
        for k, v in w.live[r].items():
            assert v.data_ptr() == ptrs[(r, k)]
            assert torch.equal(as_bytes(v), as_bytes(w.want[r][k])) or padding_only(
                v, w.want[r][k], w.old[r][k]), (r, k)
        assert sum(st.switched_bytes) == sum(
            int(p.coverage["nbytes"][p.coverage["rank"] == r].sum()) for p in plans)
    w.close()


def test_sources_running_ahead_wait_for_the_switch_before_reusing_the_buffer(tmp_path):
    """The sources run every chunk at once; the target holds each chunk 0.3 s before its
    switch: the buffer must not change meanwhile (chunk k+1's writes wait for its READY)."""
    path = str(tmp_path / "p.rplan")
    compile_chunked_file(CASES[0], BUDGET, path)
    w = World(CASES[0], path)
    t = min(w.targets)
    changed: list[int] = []
    alive: list[bool] = []
    src_threads: list[threading.Thread] = []

    def hold(k: int) -> None:
        before = w.targets[t].buffer.clone()
        time.sleep(0.3)
        alive.append(any(th.is_alive() for th in src_threads))
        if not torch.equal(before, w.targets[t].buffer):
            changed.append(k)
    src_threads.extend(threading.Thread(target=run_chunks, args=(c, 1))
                       for c in w.sources.values())
    for th in src_threads:
        th.start()
    other = [threading.Thread(target=s.run, args=(1,)) for r, s in w.targets.items() if r != t]
    for th in other:
        th.start()
    st = w.targets[t].run(1, before_switch=hold)
    for th in src_threads + other:
        th.join(60)
    assert not changed and all(alive[:-1]) and st.version == 1
    for k, v in w.live[t].items():
        assert torch.equal(as_bytes(v), as_bytes(w.want[t][k])) or padding_only(
            v, w.want[t][k], w.old[t][k]), k
    w.close()


def test_a_torn_chunk_leaves_earlier_chunks_at_n_plus_1_the_rest_at_n_then_a_whole_rerun(
        tmp_path):
    path = str(tmp_path / "p.rplan")
    plans = compile_chunked_file(CASES[0], BUDGET, path)
    torn = 2
    w = World(CASES[0], path, timeout_s=2.0)
    names = [{g.name for g in p.ranks[min(w.targets)].regions} for p in plans]
    fns = {r: (lambda c=c, r=r: run_chunks(c[:torn] if r == 0 else c, 1))
           for r, c in w.sources.items()}  # source 0 never sends chunk 2
    fns.update({r: (lambda s=s: s.run(1)) for r, s in w.targets.items()})
    _, errs = _threads(fns)
    for r, s in w.targets.items():
        assert isinstance(errs[r], TornUpdateError) and f"chunk {torn} of" in str(errs[r])
        assert "\n" not in str(errs[r]) and s.switched == torn and s.version == 0
        for k, v in w.live[r].items():
            chunk = next(i for i, n in enumerate(names) if k in n)
            if chunk < torn:  # switched: version N+1
                assert torch.equal(v, w.want[r][k]) or padding_only(
                    v, w.want[r][k], w.old[r][k]), k
            else:  # chunk 2 and after: version N, untouched
                assert torch.equal(v, w.old[r][k]), k
    # the next refit starts at chunk 0 and is whole
    for r in w.targets:
        for v in w.live[r].values():
            v.zero_()
    fns = {r: (lambda c=c: run_chunks(c, 2)) for r, c in w.sources.items()}
    fns.update({r: (lambda s=s: s.run(2)) for r, s in w.targets.items()})
    res, errs = _threads(fns)
    assert not errs, errs
    for r, s in w.targets.items():
        assert s.version == 1 and s.switched == len(plans)
        for k, v in w.live[r].items():
            got, want = as_bytes(v), as_bytes(w.want[r][k])
            assert torch.equal(got[want != 0], want[want != 0]), k
    w.close()


def test_a_budget_smaller_than_the_largest_tensor_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        compile_chunked_file(CASES[0], 1 << 16, str(tmp_path / "p.rplan"))
    msg = str(e.value)
    assert "\n" not in msg and "model.embed_tokens.weight" in msg and "65536" in msg
    assert "raise it to at least 524288" in msg
