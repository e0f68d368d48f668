"""Transport capabilities are declared (`transports.base.Capabilities`), not guessed: every
transport class states them, and the executor reads them, the conservative defaults
included (a transport that declares nothing still moves every byte)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch

import executor
import executor.transports as transports
from executor.core import Executor
from executor.transports import local
from executor.transports.base import Capabilities, Transport
from schemas.plan import load_plan
from tests.support.plans import save, two_by_two, two_by_two_expected, two_by_two_tensors


def _transport_classes() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(transports.__path__):
        mod = importlib.import_module(f"{transports.__name__}.{info.name}")
        found += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                  if c.__module__ == mod.__name__ and c is not Transport and all(
                      callable(getattr(c, m, None)) for m in ("prepare", "post", "done", "poll"))]
    return found


def test_every_transport_declares_its_capabilities():
    classes = _transport_classes()
    assert {c.__name__ for c in classes} >= {"LocalTransport", "NixlTransport",
                                             "CudaIpcTransport", "UcclTransport"}
    for c in classes:
        assert isinstance(c.__dict__.get("capabilities"), Capabilities), c.__name__
        if c.capabilities.notify_landed:  # the flag says the method is there
            assert callable(getattr(c, "notify_landed", None)), c.__name__


def test_the_defaults_are_the_conservative_ones():
    assert Capabilities() == Capabilities(ordered_posts=False, one_stream=False,
                                          graph_ops=False, fuse_batches=False,
                                          notify_landed=False)


class Plain(local.LocalTransport):
    """`local`, declaring nothing: the executor must wait for packs on the host and may not
    fuse batches."""

    capabilities = Capabilities()


def test_a_transport_declaring_nothing_runs_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "LocalTransport", Plain)  # what make_transport builds
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    plan = load_plan(path)
    ex = Executor(plan.header, plan.ranks[0], two_by_two_tensors(5)[0], transport="local",
                  rendezvous=local.Fabric(),
                  step_records=False)
    try:
        assert isinstance(ex.transport, Plain)
        assert not (ex.ordered_posts or ex.one_stream or ex.window.hand_off)
        ex.register()
        assert ex.transport.capabilities == Capabilities()  # CPU regions: nothing added
    finally:
        ex.close()
    tensors = two_by_two_tensors(5)
    executor.run_all_local(path, tensors, steps=2)
    for rank, named in two_by_two_expected(5).items():
        for name, t in named.items():
            assert torch.equal(tensors[rank][name], t), (rank, name)


def test_every_transport_has_every_method_of_the_protocol():
    """The `Transport` Protocol declares every call the executor makes (`notify_landed`
    included), and every transport of the table implements each one."""
    called = {m for m in vars(Transport) if not m.startswith("_") and callable(vars(Transport)[m])}
    assert {"notify_landed", "register", "export", "import_peer", "prepare", "post", "done",
            "notify", "poll", "peer_id", "release", "stats", "close"} <= called
    for c in _transport_classes():
        missing = [m for m in called if not callable(getattr(c, m, None))]
        assert not missing, (c.__name__, missing)


def test_the_table_names_every_transport_module():
    """One table (`transports.TRANSPORTS`): each kind's options dataclass and constructor;
    every transport module is reachable from it."""
    mods = {info.name for info in pkgutil.iter_modules(transports.__path__)}
    assert set(transports.TRANSPORTS) == {"nixl", "cuda_ipc", "uccl", "local"} <= mods
    for kind, entry in transports.TRANSPORTS.items():
        assert entry.options().__class__ is entry.options, kind  # defaults construct
