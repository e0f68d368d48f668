"""`LoadOptions`: one typed record that every way of loading a plan takes, given whole or as
keywords; a misspelt option is refused in one line naming it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import executor
from executor import ChunkedShadow, Executor, LoadOptions, Shadow, load_chunks
from executor.transports.local import Fabric
from schemas.plan import load_plan
from tests.support.plans import save, two_by_two, two_by_two_expected, two_by_two_tensors
from tests.support.threads import together


def test_every_load_has_the_one_signature():
    loads = [executor.load, Executor.load, Shadow.load, ChunkedShadow.load, load_chunks]
    for fn in loads:
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[-2:]] == ["options", "fields"], fn
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, fn
    init = list(inspect.signature(Executor.__init__).parameters)
    assert init[-2:] == ["options", "fields"]


def test_a_misspelt_option_is_one_line_naming_it():
    with pytest.raises(TypeError, match="load option 'timeout' does not exist; the options "
                       "are transport, rendezvous, timeout_s") as e:
        LoadOptions.of(None, {"timeout": 2})
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="pass LoadOptions"):
        LoadOptions.of("local", {})  # type: ignore[arg-type]


def test_keywords_override_the_record():
    o = LoadOptions(transport="local", timeout_s=3.0)
    assert LoadOptions.of(o, {}) is o
    assert LoadOptions.of(o, {"timeout_s": 5.0}) == dataclasses.replace(o, timeout_s=5.0)


def test_a_record_and_keywords_load_alike(tmp_path):
    """The same plan, once loaded from a `LoadOptions`, once from keywords: both executors
    take every option and move every byte."""
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    plan = load_plan(path)
    for how in ("record", "keywords"):
        _load_and_run(path, [rp.rank for rp in plan.ranks], how)


def _load_and_run(path: str, ranks: list[int], how: str) -> None:
    tensors = two_by_two_tensors(3)
    opts = dict(transport="local", rendezvous=Fabric(), timeout_s=5.0, max_inflight=2,
                pack_groups=0, step_records=False, no_identity=True)
    exs: dict[int, Executor] = {}

    def load(rank: int) -> None:
        exs[rank] = (Executor.load(path, rank, tensors[rank], LoadOptions(**opts))
                     if how == "record" else Executor.load(path, rank, tensors[rank], **opts))
    together(lambda r=r: load(r) for r in ranks)
    try:
        assert all(ex.max_inflight == 2 and ex.pack_groups == 0 and ex.timeout_s == 5.0
                   and not ex.step_records for ex in exs.values())
        together(lambda ex=ex: ex.run() for ex in exs.values())
        for rank, named in two_by_two_expected(3).items():
            for name, t in named.items():
                assert torch.equal(tensors[rank][name], t), (how, rank, name)
    finally:
        for ex in exs.values():
            ex.close()
