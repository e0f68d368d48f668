"""Property 6: per-NIC balance within the bound `planner/passes/assign.py` promises.

The promise (its docstring): chunks are taken in decreasing size (ties: chunk order),
single-candidate chunks counted first; a chunk goes to a candidate on the target's host
when there is one (NVLink), else to a candidate whose NIC has sent the fewest bytes so
far (ties: lowest rank). So when a chunk is assigned, its NIC's load is the least among
its candidates' NICs. Consequence: with every source rank holding the whole model, the
busiest source NIC sends at most the mean plus one chunk (`verify.balance`).

`test_assign_follows_its_rule` replays the passes up to `assign` and checks the rule for
every chunk; `test_replicated_sources_are_balanced` checks the consequence on the plan.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given

from planner.passes.assign import assign, split_rows
from planner.passes.intersect import element_size, intersect, piece_table
from planner.tools import verify
from planner.topology import build_topology
from tests.property import harness
from tests.property.strategies import Case, cases, synthetic_cases


@given(cases(fp8=False))  # FP8 scales and weights take the gather pass, not plain assign
def test_assign_follows_its_rule(case: Case) -> None:
    spec, opts = case.spec, case.cfg.options
    topo = build_topology(case.cfg.cluster, case.src.world, case.dst.world)
    src = piece_table(case.src, spec, 0)
    dst = piece_table(case.dst, spec, case.src.world)
    chunks = split_rows(intersect(spec, src, dst), dst, opts.max_write_bytes)
    choice = assign(chunks, src, dst, topo)
    nbytes = chunks.size0 * chunks.size1 * element_size(dst.dtype[chunks.dst])
    host, nic = np.asarray(topo.host), np.asarray(topo.nic)
    load: dict[tuple[str, int], int] = {}  # ("nic", id) or ("nvlink", rank) -> bytes

    def port(i: int, row: int) -> tuple[str, int]:
        r = int(src.rank[row])
        same = host[r] == host[dst.rank[chunks.dst[i]]]
        return ("nvlink", r) if same else ("nic", int(nic[r]))

    cands = [chunks.holders[chunks.holder_ptr[s]:chunks.holder_ptr[s + 1]] for s in chunks.sbox]
    for i in range(len(chunks)):
        assert choice[i] in cands[i], f"chunk {i}: source row {choice[i]} does not hold it"
        if len(cands[i]) == 1:
            p = port(i, int(choice[i]))
            load[p] = load.get(p, 0) + int(nbytes[i])
    multi = [i for i in range(len(chunks)) if len(cands[i]) > 1]
    for i in sorted(multi, key=lambda i: -int(nbytes[i])):  # stable: ties in chunk order
        d_host = host[dst.rank[chunks.dst[i]]]
        local = [h for h in cands[i].tolist() if host[src.rank[h]] == d_host]
        chosen = port(i, int(choice[i]))
        if local:
            assert chosen[0] == "nvlink", f"chunk {i}: a same-host source exists, NIC used"
        else:
            least = min(load.get(port(i, h), 0) for h in cands[i].tolist())
            assert load.get(chosen, 0) == least, (
                f"chunk {i} ({int(nbytes[i])} bytes) went to {chosen} with load "
                f"{load.get(chosen, 0)}; a candidate NIC had only {least}")
        load[chosen] = load.get(chosen, 0) + int(nbytes[i])


@given(synthetic_cases(replicated=True))
def test_replicated_sources_are_balanced(case: Case) -> None:
    plan = harness.compile_case(case)
    assert verify.fully_replicated(plan.header)
    assert verify.balance(plan) == []
