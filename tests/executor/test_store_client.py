"""A store the launcher already hosts: rank 0 given its `"host:port"` tries to
host a second one there (EADDRINUSE); the error says to pass a client of it, and
`executor.connect_store` is that client."""

from __future__ import annotations

import pytest

import executor
from executor.errors import RendezvousError
from executor.rendezvous import open_store
from harness.launch import master_store


def test_rank0_on_the_launchers_store_is_told_to_pass_a_client():
    launcher, port = master_store(10)  # what torchrun's agent (or a launcher script) hosts
    addr = f"127.0.0.1:{port}"
    with pytest.raises(RendezvousError) as e:
        open_store(addr, 0, 5.0)
    msg = str(e.value)
    assert f"rendezvous=executor.connect_store('{addr}')" in msg and "\n" not in msg
    assert "pick a free port" not in msg  # the old advice: wrong when a launcher hosts it
    # the client the message names: every rank, rank 0 included, reaches the one store
    client = executor.connect_store(addr, timeout_s=5.0)
    store = open_store(client, 0, 5.0)
    store.set("rplan/probe", b"x")
    assert launcher.get("rplan/probe") == b"x" and store.get("rplan/missing") is None
    with pytest.raises(ValueError, match="is not 'host:port'"):
        executor.connect_store("nohost")


def test_an_engines_hosted_rendezvous_is_a_client_on_every_rank():
    """`store_at` (the integrations' `rendezvous_hosted`): hosted, rank 0 included reaches
    the launcher's store as a client; not hosted, the address goes on as is (rank 0 would
    host a store there)."""
    from executor.rendezvous import store_at

    launcher, port = master_store(10)
    addr = f"127.0.0.1:{port}"
    assert store_at(addr, False, 5.0) == addr
    ranks = [open_store(store_at(addr, True, 5.0), r, 5.0) for r in (0, 1)]
    ranks[1].set("rplan/r1", b"1")
    assert ranks[0].get("rplan/r1") == b"1" and launcher.get("rplan/r1") == b"1"
