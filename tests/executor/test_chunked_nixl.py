"""Chunked shadow over NIXL between four processes (`chunked_worker.py`): the tiny gpt-oss,
FSDP2 -> vLLM TP 2 (UNPACKs on the targets), through one 2 MiB buffer per target in 3
chunks: bit-exact, then a torn chunk (what it leaves), then whole again."""

from __future__ import annotations

import os

import pytest

from tests.support.nixl_world import exited_0, nixl_world
from tests.support.shadow_plans import CASES, compile_chunked_file

pytestmark = pytest.mark.processes  # ranks as separate processes (tests/conftest.py)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chunked_worker.py")


@pytest.mark.extended
def test_four_nixl_processes_chunked_refit_bit_exact_torn_chunk_then_whole(tmp_path):
    pytest.importorskip("nixl")
    path = str(tmp_path / "p.rplan")
    assert len(compile_chunked_file(CASES[1], 2 << 20, path)) == 3
    done = nixl_world(WORKER, path, timeout=300)
    exited_0(done)
    for f in done[2:]:
        out = f.output
        assert f"rank {f.rank} step 1: OK bit-exact through 3 chunks" in out, out
        assert f"rank {f.rank} step 2: OK torn at chunk 1" in out, out
        assert f"rank {f.rank} step 3: OK whole again, bit-exact" in out, out
