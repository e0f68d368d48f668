"""`cuda_ipc`'s one way down (`ipc_modes.Ladder`): each fallback lowers the posting mode or
turns the copy kernel off, for good, is recorded with its reason and warned once (any
machine: pure bookkeeping, no GPU touched; the GPU run is tests/executor/test_cuda_ipc.py)."""

from __future__ import annotations

import warnings

import pytest

from executor.transports.ipc_modes import Ladder, Mode


def _warned(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w]


def test_each_failure_goes_down_once_with_its_reason_and_never_back_up():
    lad = Ladder(rank=3, kernel=True)
    assert lad.mode is Mode.FAST and lad.kernel and lad.degraded == []
    said = _warned(lambda: lad.degrade("copy_kernel", "capture failed: boom"))
    assert lad.mode is Mode.FAST and not lad.kernel  # posts stay fast, new batches: engines
    assert len(said) == 1 and said[0].startswith("rank 3: cuda_ipc turned copy_kernel off "
                                                 "(capture failed: boom); ")
    said = _warned(lambda: lad.degrade("fast_post", "error 700"))
    assert lad.mode is Mode.RUNTIME and len(said) == 1 and "error 700" in said[0]
    # the same failure again, or a lesser one after a greater: nothing new, no second warning
    assert _warned(lambda: lad.degrade("fast_post", "error 701")) == []
    assert _warned(lambda: lad.degrade("copy_kernel", "again")) == []
    said = _warned(lambda: lad.degrade("runtime", "cudaMemcpyAsync failed (error 1)"))
    assert lad.mode is Mode.TORCH and len(said) == 1 and "torch copies" in said[0]
    assert _warned(lambda: lad.degrade("fast_post", "late")) == []
    assert lad.mode is Mode.TORCH
    assert lad.degraded == [("copy_kernel", "capture failed: boom"), ("fast_post", "error 700"),
                            ("runtime", "cudaMemcpyAsync failed (error 1)")]


def test_the_runtime_going_takes_the_kernel_with_it_and_start_is_quiet():
    lad = Ladder(rank=0, kernel=True)
    assert _warned(lambda: lad.degrade("runtime", "no libcudart", warn=False)) == []
    assert lad.mode is Mode.TORCH and not lad.kernel  # the kernel needs the runtime
    assert not lad.degrade("copy_kernel", "does not build", warn=False)  # off already
    assert lad.degraded == [("runtime", "no libcudart")]
    off = Ladder(rank=0, kernel=False)  # copy_kernel: false is a choice, not a fallback
    assert not off.degrade("copy_kernel", "not asked", warn=False) and off.degraded == []


def test_a_transport_starts_below_the_top_where_its_process_lacks_something():
    full = Ladder.at_start(0, copy_kernel=True, runtime=True, raw_posts=True, kernel_built=True)
    assert full.mode is Mode.FAST and full.kernel and full.degraded == []
    old_torch = Ladder.at_start(0, True, runtime=True, raw_posts=False, kernel_built=True)
    assert old_torch.mode is Mode.RUNTIME and old_torch.kernel
    assert [w for w, _ in old_torch.degraded] == ["fast_post"]
    no_nvrtc = Ladder.at_start(0, True, runtime=True, raw_posts=True, kernel_built=False)
    assert no_nvrtc.mode is Mode.FAST and not no_nvrtc.kernel
    assert [w for w, _ in no_nvrtc.degraded] == ["copy_kernel"]
    bare = Ladder.at_start(0, True, runtime=False, raw_posts=False, kernel_built=False)
    assert bare.mode is Mode.TORCH and not bare.kernel
    assert bare.degraded == [("runtime", "no libcudart in this process")]
    unasked = Ladder.at_start(0, copy_kernel=False, runtime=True, raw_posts=True,
                              kernel_built=False)  # copy_kernel: false
    assert unasked.mode is Mode.FAST and not unasked.kernel and unasked.degraded == []


def test_an_unknown_step_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="cannot turn off 'graphs'; it turns off one of "
                                         "copy_kernel, fast_post, runtime"):
        Ladder(rank=0, kernel=True).degrade("graphs", "?")
