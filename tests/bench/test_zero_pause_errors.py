"""bench/zero_pause.py runs every rank on a thread of its own: a rank's exception must end
the run in one line, not vanish while its peers wait out their timeout."""

from __future__ import annotations

import threading

import pytest

from bench import zero_pause


def test_a_rank_that_raises_ends_the_run_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zero_pause, "ERRORS", [])

    def fails() -> None:
        raise RuntimeError("CUDA error: operation not permitted\nsecond line")

    def fine() -> None:
        pass

    threads = [threading.Thread(target=zero_pause._guarded(fine, "rank 0 step 1")),
               threading.Thread(target=zero_pause._guarded(fails, "rank 2 step 1"))]
    with pytest.raises(SystemExit) as e:
        zero_pause._join(threads)
    assert str(e.value) == ("zero_pause: rank 2 step 1: RuntimeError: CUDA error: operation "
                            "not permitted")


def test_ranks_that_return_end_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zero_pause, "ERRORS", [])
    done: list[int] = []
    zero_pause._join([threading.Thread(target=zero_pause._guarded(done.append, f"rank {r}"),
                                       args=(r,)) for r in range(3)])
    assert sorted(done) == [0, 1, 2]
