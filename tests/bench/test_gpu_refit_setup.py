"""Who runs where in the GPU refit benchmark (`bench.gpu_refit.setup`): `--gpus 1` puts the
2-GPU ranks on one device, with the 2-GPU plans, and no NCCL baseline."""

from __future__ import annotations

import pytest

from bench.gpu_refit.cli import parse_args
from bench.gpu_refit.setup import Setup


def test_one_gpu_runs_the_two_gpu_ranks_on_gpu_0() -> None:
    one, two = Setup.for_gpus(1), Setup.for_gpus(2)
    assert (one.world, one.trainers, one.targets) == (two.world, two.trainers, two.targets)
    assert [one.gpu(r) for r in range(one.world)] == [0, 0]
    assert [two.gpu(r) for r in range(two.world)] == [0, 1]
    assert [Setup.for_gpus(4).gpu(r) for r in range(4)] == [0, 1, 2, 3]
    assert one.config("qwen3-8b") == two.config("qwen3-8b")  # the same plans


def test_one_gpu_has_no_nccl_baseline() -> None:
    assert parse_args(["--gpus", "1"]).no_baseline
    assert not parse_args(["--gpus", "2"]).no_baseline


def test_other_counts_are_refused_naming_the_choices() -> None:
    with pytest.raises(SystemExit, match="--gpus 3: 4 .*2, or 1"):
        Setup.for_gpus(3)
