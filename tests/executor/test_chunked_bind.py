"""`ChunkedShadow` binds the live tensors as `load` and `Shadow` do: name, shape, dtype and
contiguity against the plan, every chunk, before any chunk connects (a live tensor of the
right byte size but another dtype or shape is refused, naming it)."""

from __future__ import annotations

import pytest
import torch

from executor.chunked import ChunkedShadow
from executor.errors import BindError
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from tests.support.shadow_plans import CASES, compile_chunked_file, layouts

BUDGET = 1 << 20


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bb") / "p.rplan")
    compile_chunked_file(CASES[0], BUDGET, path)
    spec, src, dst = layouts(CASES[0])
    live = materialize(dst, random_full_tensors(spec, seed=1))[0]
    return path, src.world, live


def _same_bytes(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "dtype":  # float32 where the plan says bf16: the same bytes, half the elements
        return torch.zeros(t.numel() // 2, dtype=torch.float32).view(*t.shape[:-1],
                                                                        t.shape[-1] // 2)
    if how == "shape":
        return t.clone().reshape(-1)
    if how == "contiguity":
        return t.clone().t().contiguous().t() if t.dim() == 2 else t
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["dtype", "shape", "contiguity"])
def test_a_live_tensor_unlike_the_plan_is_refused_naming_it(plan, how: str) -> None:
    path, rank, live = plan
    name = next(n for n, t in live.items() if t.dim() == 2 and t.shape[0] > 1
                and t.shape[1] % 2 == 0)
    bad = dict(live, **{name: _same_bytes(live[name], how)})
    assert bad[name].numel() * bad[name].element_size() == live[name].numel() * 2
    with pytest.raises(BindError) as e:
        ChunkedShadow.load(path, rank, bad, transport="local", rendezvous=Fabric(), timeout_s=2,
                           no_identity=True)
    assert name in str(e.value) and {"dtype": "dtype float32 != plan bfloat16",
                                     "shape": "shape", "contiguity": "not contiguous"}[how] \
        in str(e.value)
