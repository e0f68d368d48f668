"""The executor over the `local` transport: bit-exact results, speed, lockstep deadlocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import executor
from executor import PlanDeadlockError
from schemas.plan import QUANT
from tests.support.clock import cpu_seconds
from tests.support.plans import (
    BF16,
    DONE,
    DTYPE_CODES,
    READY,
    STAGING,
    Region,
    copy,
    rank_plan,
    region,
    save,
    two_by_two,
    two_by_two_expected,
    two_by_two_tensors,
)


def test_two_by_two_is_bit_exact(tmp_path):
    # direct writes (W row halves) and pack(fp32 -> bf16) -> write -> unpack(transpose)
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    for seed in (1, 2):
        tensors = two_by_two_tensors(seed)
        stats = executor.run_all_local(path, tensors)
        want = two_by_two_expected(seed)
        for rank, named in want.items():
            for name, t in named.items():
                assert torch.equal(tensors[rank][name], t), (rank, name)
        assert stats.bytes == 2 * 4 * 8 + 2 * 16 and stats.complete


def test_each_step_moves_that_steps_weights_on_cpu(tmp_path):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    tensors = two_by_two_tensors(0)

    def refill(step: int) -> None:
        for rank, named in two_by_two_tensors(step).items():
            for k, t in named.items():
                tensors[rank][k].copy_(t)  # the targets' are zeros

    stats = executor.run_all_local(path, tensors, steps=3, before_step=refill)
    assert stats.step == 3 and not stats.graphed  # no step graph on a CPU
    for rank, named in two_by_two_expected(3).items():
        for name, t in named.items():
            assert torch.equal(tensors[rank][name], t), (rank, name)


def test_cast_rounds_to_nearest_even(tmp_path):
    ranks = two_by_two()
    tensors = two_by_two_tensors(0)
    # 1 + 2^-8 is a tie between bf16 1.0 and 1.0078125: nearest even is 1.0
    tensors[0]["b"][:] = 1.0 + 2.0 ** -8
    executor.run_all_local(save(str(tmp_path / "p.rplan"), ranks), tensors)
    assert torch.equal(tensors[2]["bt"], torch.ones(4, 4, dtype=torch.bfloat16))


def test_hundred_thousand_writes_run_in_seconds(tmp_path):
    # source 0 "x" [n*16] u8 is cut into n chunks of 16 bytes; chunk i lands at position
    # perm[i] of target 1 "x". Half of them go through a group of 48-byte writes instead.
    n = 100_000
    perm = np.random.default_rng(0).permutation(n)
    writes = [(0, 1, 0, i * 16, 0, int(perm[i]) * 16, 16) for i in range(n)]
    x = region("x", "uint8", (n * 16,))
    src = rank_plan(0, "source", [x], writes, signals=[(0, 1, DONE)], waits=[(0, 1, READY)],
                    peer_regions={1: (x.nbytes,)})
    tgt = rank_plan(1, "target", [x], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    path = save(str(tmp_path / "p.rplan"), [src, tgt])
    data = torch.randint(0, 256, (n * 16,), dtype=torch.uint8)
    out = torch.zeros_like(data)
    t0 = cpu_seconds()
    stats = executor.run_all_local(path, {0: {"x": data}, 1: {"x": out}}, steps=2)
    assert cpu_seconds() - t0 < 10  # bounded work (CPU seconds of all threads), not a timing
    inv = torch.from_numpy(np.argsort(perm))
    assert torch.equal(out.view(n, 16)[torch.from_numpy(perm)], data.view(n, 16))
    assert torch.equal(out.view(n, 16), data.view(n, 16)[inv])
    assert stats.bytes == n * 16


def test_wait_without_signal_is_a_deadlock(tmp_path):
    x = region("x", "uint8", (8,))
    src = rank_plan(0, "source", [x], [(0, 1, 0, 0, 0, 0, 8)], peer_regions={1: (8,)},
                    signals=[(0, 1, DONE)],
                    waits=[(0, 1, READY)])  # the target never sends READY
    tgt = rank_plan(1, "target", [x])
    path = save(str(tmp_path / "p.rplan"), [src, tgt])
    with pytest.raises(PlanDeadlockError, match="peer rank 1"):
        executor.run_all_local(path, {0: {"x": torch.zeros(8, dtype=torch.uint8)},
                                      1: {"x": torch.zeros(8, dtype=torch.uint8)}})


def _quant_plan(tmp_path) -> str:
    # source 0 holds "w" bf16 [200, 300] (2 x 3 blocks of 128, partial at the edges). QUANT
    # puts its 60000 e4m3 values at staging byte 0 and its 2 x 3 fp32 scales at staging
    # float 15000 (byte 60000); two writes send them to target 1's "w" (e4m3 [200, 300])
    # and "w_scale_inv" (fp32 [2, 3]).
    fp8 = DTYPE_CODES.index("float8_e4m3fn")
    w = region("w", "bfloat16", (200, 300))
    st = Region(STAGING, "uint8", (60024,), 60024)
    q = copy(QUANT, 0, (0, BF16, 0, (300, 1, 0)), (1, fp8, 0, (300, 1, 0)), (200, 300, 1),
             aux_offset=15000)
    tw, ts = Region("w", "float8_e4m3fn", (200, 300), 60000), region("w_scale_inv",
                                                                     "float32", (2, 3))
    src = rank_plan(0, "source", [w, st], [(0, 1, 1, 0, 0, 0, 60000), (0, 1, 1, 60000, 1, 0, 24)],
                    copies=[q], signals=[(0, 1, DONE)], waits=[(0, 1, READY)],
                    peer_regions={1: (60000, 24)})
    tgt = rank_plan(1, "target", [tw, ts], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    return save(str(tmp_path / "p.rplan"), [src, tgt])


def test_quant_into_staging_then_write_matches_the_reference(tmp_path):
    path = _quant_plan(tmp_path)
    x = torch.randn(200, 300).to(torch.bfloat16)
    x[:128, :128] = 0  # an all-zero block takes the 1e-4 floor
    out = {"w": torch.zeros(200, 300, dtype=torch.float8_e4m3fn),
           "w_scale_inv": torch.zeros(2, 3)}
    executor.run_all_local(path, {0: {"w": x}, 1: out})
    fp8mod = pytest.importorskip("harness.weights")
    want_q, want_s = fp8mod.quantize_block128(x)
    assert torch.equal(out["w_scale_inv"], want_s)
    assert torch.equal(out["w"].view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_by_two_on_gpu(tmp_path):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    tensors = {r: {k: t.cuda() for k, t in named.items()}
               for r, named in two_by_two_tensors(3).items()}
    executor.run_all_local(path, tensors)
    for rank, named in two_by_two_expected(3).items():
        for name, t in named.items():
            assert torch.equal(tensors[rank][name].cpu(), t), (rank, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("step_graph", [True, False], ids=["step-graph", "host-protocol"])
def test_later_steps_move_new_weights(tmp_path, step_graph):
    """From step 2 on a GPU world runs as one graph of the whole step (packs, writes and
    unpacks of both sources): each step must move that step's weights, not replay the
    first step's bytes. Targets are zeroed before every step so nothing stale can pass."""
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    tensors = {r: {k: t.cuda() for k, t in named.items()}
               for r, named in two_by_two_tensors(0).items()}

    def refill(step: int) -> None:
        for rank, named in two_by_two_tensors(step).items():
            for k, t in named.items():
                tensors[rank][k].copy_(t.cuda())  # the targets' are zeros

    stats = executor.run_all_local(path, tensors, steps=4, before_step=refill,
                                   transport_options={"step_graph": step_graph})
    assert stats.graphed is step_graph
    for rank, named in two_by_two_expected(4).items():
        for name, t in named.items():
            assert torch.equal(tensors[rank][name].cpu(), t), (rank, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_graph_quantizes_each_steps_weights(tmp_path):
    """QUANT (FP8 block scales into staging, then writes) inside the whole-step graph: the
    last of three steps' weights, each step's different, bit-exact against the reference."""
    fp8mod = pytest.importorskip("harness.weights")
    path = _quant_plan(tmp_path)
    xs = [torch.randn(200, 300).to(torch.bfloat16) * (k + 1) for k in range(3)]
    w = xs[0].cuda()
    out = {"w": torch.zeros(200, 300, dtype=torch.float8_e4m3fn, device="cuda"),
           "w_scale_inv": torch.zeros(2, 3, device="cuda")}
    stats = executor.run_all_local(path, {0: {"w": w}, 1: out}, steps=3,
                                   before_step=lambda k: w.copy_(xs[k - 1].cuda()))
    assert stats.graphed
    want_q, want_s = fp8mod.quantize_block128(xs[2])
    assert torch.equal(out["w_scale_inv"].cpu(), want_s)
    assert torch.equal(out["w"].view(torch.uint8).cpu(), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_runs_one_after_another_capture_their_graphs(tmp_path):
    """A collection during a capture used to free an earlier run's graphs (destroying a
    graph voids a capture in progress) and left the shared pool recording: every later
    capture failed and the copies ran one by one, with a warning."""
    import gc
    import warnings
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at nearly every allocation
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(4):
                tensors = {r: {k: t.cuda() for k, t in named.items()}
                           for r, named in two_by_two_tensors(3).items()}
                executor.run_all_local(path, tensors)
    finally:
        gc.set_threshold(*old)
    for rank, named in two_by_two_expected(3).items():
        for name, t in named.items():
            assert torch.equal(tensors[rank][name].cpu(), t), (rank, name)
