"""Chunked shadow over NIXL between four processes (`chunked_worker.py`): the tiny gpt-oss,
FSDP2 -> vLLM TP 2 (UNPACKs on the targets), through one 2 MiB buffer per target in 3
chunks: bit-exact, then a torn chunk (what it leaves), then whole again."""

from __future__ import annotations

import os
import secrets
import sys

import pytest

from tests.support.shadow_plans import CASES, compile_chunked_file

pytestmark = pytest.mark.processes  # ranks as separate processes (tests/conftest.py)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chunked_worker.py")


@pytest.mark.extended
def test_four_nixl_processes_chunked_refit_bit_exact_torn_chunk_then_whole(tmp_path):
    pytest.importorskip("nixl")
    from harness.launch import master_store, root_env, spawn_ranks
    path = str(tmp_path / "p.rplan")
    assert len(compile_chunked_file(CASES[1], 2 << 20, path)) == 3
    store, port = master_store(30)  # noqa: F841 (alive while the ranks run)
    env = root_env(NIXL_LOG_LEVEL="WARN", RDMA_PLAN_SECRET=secrets.token_hex(32))
    done = spawn_ranks(lambda r: [sys.executable, WORKER, path, str(r), f"127.0.0.1:{port}"],
                       4, env=env, timeout=300)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"
    for f in done[2:]:
        out = f.output
        assert f"rank {f.rank} step 1: OK bit-exact through 3 chunks" in out, out
        assert f"rank {f.rank} step 2: OK torn at chunk 1" in out, out
        assert f"rank {f.rank} step 3: OK whole again, bit-exact" in out, out
