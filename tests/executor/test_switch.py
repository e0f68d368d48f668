"""A shadow's switch (`executor/switch.py`): the copies of each chunk, one launch on a GPU (a
graph of `copy_`s, or the copy kernel for many; `pytest -m gpu`), eager `copy_`s
elsewhere; bit-exact, only the named bytes, every destination's `data_ptr` kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.gpu.copy_kernel import CHUNK
from executor.switch import MANY, MIN_PIECE, SwitchCopies, piece_bytes


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1 << 34), st.integers(1, 4096))
def test_piece_is_a_multiple_of_16_between_the_bounds(total, blocks):
    p = piece_bytes(total, blocks)
    assert p % 16 == 0 and MIN_PIECE <= p <= CHUNK


def _case(device: torch.device) -> tuple[list, torch.Tensor, torch.Tensor, list[int]]:
    """Two chunks of byte ranges (some at odd offsets and lengths) of two flat buffers."""
    g = torch.Generator().manual_seed(5)
    live = torch.zeros(5 << 20, dtype=torch.uint8).to(device)
    shadow = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=g).to(device)
    ranges = [[(0, 1 << 20), (1 << 20 | 3, 77_777)], [(2 << 20 | 1, 5), (2 << 20 | 64, 900_001)],
              [((3 << 20) + 3 + 4096 * i, 1 + 13 * i) for i in range(MANY + 1)]]
    chunks = [[(live[o:o + n], shadow[o:o + n]) for o, n in chunk] for chunk in ranges]
    return chunks, live, shadow, [o for chunk in ranges for o, _ in chunk]


def _check(sw: SwitchCopies, chunks: list, live: torch.Tensor, shadow: torch.Tensor) -> None:
    ptr = live.data_ptr()
    for k in range(len(chunks)):
        sw.copy(k)
        sw.sync()
        want = torch.zeros_like(live)
        for j in range(k + 1):
            for d, s in chunks[j]:
                off = d.data_ptr() - ptr
                want[off:off + d.numel()] = s
        assert torch.equal(live, want), f"after chunk {k}: other bytes or a wrong copy"
    assert live.data_ptr() == ptr


def test_cpu_switch_copies_each_chunk_and_only_its_bytes():
    chunks, live, shadow, _ = _case(torch.device("cpu"))
    sw = SwitchCopies(chunks)
    assert not sw.one_launch and sw.kind == ["eager"] * 3
    _check(sw, chunks, live, shadow)


def test_non_contiguous_pairs_are_copied_eagerly():
    live, shadow = torch.zeros(64, 32).t(), torch.randn(32, 64)
    sw = SwitchCopies([[(live, shadow)]])
    sw.copy(0)
    assert torch.equal(live, shadow) and not sw.one_launch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_switch_is_one_launch_bit_exact_and_in_place():
    chunks, live, shadow, _ = _case(torch.device("cuda", 0))
    sw = SwitchCopies(chunks)
    assert sw.kind == ["graph", "graph", "kernel"], sw.kind  # few copies; many: the kernel
    assert sw.one_launch
    _check(sw, chunks, live, shadow)
    # a non-contiguous pair: its copy_ in the graph, still one launch and right
    a, b = torch.zeros(64, 32, device="cuda").t(), torch.randn(32, 64, device="cuda")
    nc = SwitchCopies([[(a, b)]])
    nc.copy(0)
    nc.sync()
    assert torch.equal(a, b) and nc.kind == ["graph"]
