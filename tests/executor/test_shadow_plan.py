"""`Shadow` driven by the plan's switch ops (`target.shadow: full`): a compiled plan of the
tiny Qwen3 and the tiny gpt-oss (UNPACKs on the targets), every rank in one process
(`local`): live keeps version N until the switch, equals N+1 after it in place, and the
switch copies exactly the bytes the plan writes (bytes it does not write keep what the
engine holds there)."""

from __future__ import annotations

import threading

import pytest
import torch

from executor import Executor, Shadow
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from schemas.plan import load_plan
from schemas.plan_write import write_plan
from tests.support.shadow_plans import CASES, _broken, _compile
from tests.support.shadow_plans import layouts as _layouts


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_switch_by_the_plans_ops_is_bit_exact_in_place_and_touches_only_written_bytes(
        case, tmp_path):
    path = str(tmp_path / "p.rplan")
    write_plan(path, _compile(case, "full"))
    plan = load_plan(path)
    spec, src_l, dst_l = _layouts(case)
    n_src = src_l.world
    old, new = random_full_tensors(spec, seed=1), random_full_tensors(spec, seed=2)
    src = materialize(src_l, new)
    live = {n_src + r: t for r, t in materialize(dst_l, old).items()}
    fabric = Fabric()
    shadows = {r: Shadow(live[r]) for r in live}
    # the engine writes bytes no plan op writes (padding rows) after the shadow was made:
    # a whole-tensor switch would put the shadow's stale copy back over them
    for t in live.values():
        for v in t.values():
            v.view(-1)[-1:] = 3.0 if v.is_floating_point() else 3
    kept = {r: {k: v.clone() for k, v in t.items()} for r, t in live.items()}
    ptrs = {(r, k): v.data_ptr() for r, t in live.items() for k, v in t.items()}
    sources = [Executor(plan.header, plan.ranks[r], src[r], transport="local", rendezvous=fabric,
                        timeout_s=20)
               for r in range(n_src)]
    targets = [Executor(plan.header, plan.ranks[r], shadows[r].tensors, transport="local",
                        rendezvous=fabric,
                        timeout_s=20) for r in live]
    for ex in sources + targets:
        ex.register()
    for ex in sources + targets:
        ex.connect()
    for ex in targets:
        shadows[ex.rank].attach(ex)
        assert shadows[ex.rank].ops is not None
    for s in shadows.values():
        s.start(1)
    threads = [threading.Thread(target=ex.run, args=(1,)) for ex in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r, s in shadows.items():
        s.finish(60)
        for k, v in live[r].items():  # every byte landed, in the shadow only
            assert torch.equal(v, kept[r][k]), (r, k)
    want = {n_src + r: t for r, t in materialize(dst_l, new).items()}
    cov = plan.coverage
    for r, s in shadows.items():
        s.switch()
        assert s.last is not None and s.last.switched_bytes == s.switched_bytes
        assert s.switched_bytes == int(cov["nbytes"][cov["rank"] == r].sum()) <= s.extra_bytes
        if case[0] == "tiny-qwen3":  # its vocab padding is bytes no op writes
            assert s.switched_bytes < s.extra_bytes
        for k, v in live[r].items():
            assert v.data_ptr() == ptrs[(r, k)]
            # written bytes are version N+1; bytes the plan does not write keep the engine's
            got, exp, was = (x.reshape(-1).view(torch.uint8) for x in (v, want[r][k],
                                                                          kept[r][k]))
            written = torch.zeros_like(got, dtype=torch.bool)
            sec = plan.ranks[r].shadow.regions
            names = [g.name for g in plan.ranks[r].regions]
            for reg, o, n in zip(sec["region"].tolist(), sec["offset"].tolist(),
                                 sec["nbytes"].tolist()):
                if names[reg] == k:
                    written[o:o + n] = True
            assert torch.equal(got[written], exp[written]), (r, k)
            assert torch.equal(got[~written], was[~written]), (r, k)
    for ex in sources:
        ex.close()
    for s in shadows.values():
        s.close()


def test_a_chunked_section_is_refused_by_shadow_in_one_line(tmp_path):
    path = str(tmp_path / "p.rplan")
    write_plan(path, _compile(CASES[0], {"budget_bytes": 1 << 20})[0])  # one chunk plan
    plan = load_plan(path)
    _, src_l, dst_l = _layouts(CASES[0])
    t = src_l.world
    live = materialize(dst_l, random_full_tensors(_layouts(CASES[0])[0], seed=1))[0]
    shadow = Shadow(live)
    ex = Executor(plan.header, plan.ranks[t], shadow.tensors, transport="local",
                  rendezvous=Fabric(), timeout_s=2)
    with pytest.raises(ValueError) as e:
        shadow.attach(ex)
    assert "chunked shadow (1,048,576 bytes" in str(e.value) and "\n" not in str(e.value)
    ex.close()


def test_a_tampered_section_in_a_file_is_refused_by_the_loader_before_binding(tmp_path):
    import dataclasses

    from executor.errors import PlanBoundsError

    plan = _compile(CASES[0], "full")
    t = next(rp for rp in plan.ranks if rp.role == "target")
    _, _, dst_l = _layouts(CASES[0])
    live = materialize(dst_l, random_full_tensors(_layouts(CASES[0])[0], seed=1))[0]
    for what in ("overlap", "gap", "chunk order"):
        bad = _broken(t)[what]
        path = str(tmp_path / f"{what}.rplan")
        write_plan(path, dataclasses.replace(plan, ranks=tuple(
            bad if r.rank == t.rank else r for r in plan.ranks)))
        with pytest.raises(PlanBoundsError) as e:
            Executor.load(path, t.rank, live, transport="local", rendezvous=Fabric(),
                          no_identity=True)
        assert "shadow" in str(e.value) and "\n" not in str(e.value), what
