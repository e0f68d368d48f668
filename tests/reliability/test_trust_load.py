"""Issue 35, the trust second pass at load: roles in the bounds proof, the executor refusing
what `verify` refuses, staging capped before it is allocated, declared sizes checked
against the bytes really in the file.

Each plan here is a tampered plan with valid checksums (no key given): the executor must
refuse it before it allocates, registers or writes anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from schemas.bounds import violations
from schemas.plan import DTYPE_CODES, PACK, STAGING, Plan, Table, load_plan
from schemas.plan_write import write_plan
from tests.property import fuzz

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    return fuzz.base_plans(str(tmp_path_factory.mktemp("bases")))


def _with_rank(plan: Plan, rp) -> Plan:
    return dataclasses.replace(plan, ranks=tuple(rp if q.rank == rp.rank else q
                                                 for q in plan.ranks))


def _set(t: Table, **cols_at: tuple[int, int]) -> Table:
    cols = {n: np.array(t[n]) for n, _ in t.schema}
    for col, (row, value) in cols_at.items():
        cols[col][row] = value
    return Table.build(t.schema, **cols)


def pack_into_own_weight(plan: Plan) -> tuple[Plan, str]:
    """Source 0's first PACK from a weight made to write that weight instead of staging
    (its own dtype, offset 0): inside the region, so the bounds proof alone passes it."""
    rp = plan.ranks[0]
    c = rp.copies
    sg = len(rp.regions) - 1
    i = int(np.flatnonzero((c["kind"] == PACK) & (c["src_region"] != sg))[0])
    reg = int(c["src_region"][i])
    code = DTYPE_CODES.index(rp.regions[reg].dtype)
    bad = dataclasses.replace(rp, copies=_set(c, dst_region=(i, reg), dst_dtype=(i, code),
                                              dst_offset=(i, 0)))
    assert next(violations(bad, len(plan.ranks)), None) is None  # bounds-only: passes
    return _with_rank(plan, bad), rp.regions[reg].name


def _run(worker: fuzz.Worker, base: str, plan: Plan, tmp_path) -> dict:
    path = str(tmp_path / "mutant.rplan")
    write_plan(path, plan)
    return worker.serve_one(base, path)


def test_a_pack_into_a_source_weight_is_refused_at_load(bases, tmp_path) -> None:
    plan, name = pack_into_own_weight(load_plan(bases["cast"]))
    ans = _run(fuzz.Worker(), bases["cast"], plan, tmp_path)
    assert not ans["run"]["ok"], "the executor ran a PACK into a source's own weight"
    assert ans["run"]["type"] == "PlanBoundsError" and "staging" in ans["run"]["msg"]
    assert name in ans["run"]["msg"]
    assert ans["sources_ok"] and ans["guards_ok"]
    assert ans["verify"]["ok"]  # verify reads it (and finds violations: below)
    from planner.tools.verify import verify_plan

    assert any("not its staging" in m for m in verify_plan(plan))


def _drop_done(plan: Plan) -> Plan:
    """Source 0 sends no DONE for its first (stage, peer); that peer waits for none: the
    writes land unannounced, the target may unpack before they have."""
    from schemas.plan import DONE

    rp = plan.ranks[0]
    s = rp.signals
    i = int(np.flatnonzero(s["kind"] == DONE)[0])
    stage, peer = int(s["stage"][i]), int(s["peer"][i])
    keep = np.arange(len(s)) != i
    rp = dataclasses.replace(rp, signals=Table.build(
        s.schema, **{n: np.array(s[n])[keep] for n, _ in s.schema}))
    tp = plan.ranks[peer]
    w = tp.waits
    keep = ~((w["kind"] == DONE) & (w["peer"] == 0) & (w["stage"] == stage))
    tp = dataclasses.replace(tp, waits=Table.build(
        w.schema, **{n: np.array(w[n])[keep] for n, _ in w.schema}))
    return _with_rank(_with_rank(plan, rp), tp)


def _small_writes(plan: Plan) -> Plan:
    """The header's max_write_bytes below the plan's largest write."""
    opts = dataclasses.replace(plan.header.options, max_write_bytes=4096)
    return dataclasses.replace(plan, header=dataclasses.replace(plan.header, options=opts))


@pytest.mark.parametrize("mutate", [_drop_done, _small_writes], ids=["no-DONE", "max-write"])
def test_a_plan_verify_rejects_is_refused_at_load(bases, tmp_path, mutate) -> None:
    from planner.tools.verify import verify_plan

    plan = mutate(load_plan(bases["cast"]))
    assert verify_plan(plan), "the mutant must be one verify rejects"
    ans = _run(fuzz.Worker(), bases["cast"], plan, tmp_path)
    assert not ans["run"]["ok"] and ans["run"]["type"] == "PlanBoundsError", ans["run"]


def _staging_plan(path: str, staging: int, budget: int) -> str:
    from tests.support.plans import rank_plan, region

    x = region("x", "uint8", (8,))
    st = dataclasses.replace(region(STAGING, "uint8", (staging,)), nbytes=staging)
    src = rank_plan(0, "source", [x, st])
    tgt = rank_plan(1, "target", [x])
    from schemas.config import Options
    from schemas.header import PlanHeader

    header = PlanHeader(fingerprint="big-staging", world=2,
                        options=Options(staging_bytes=budget))
    write_plan(path, Plan(header=header, ranks=(src, tgt)))
    return path


CHILD = """
import json, resource, sys, time
limit = 1 << 30
resource.setrlimit(resource.RLIMIT_AS, (3 * limit, 3 * limit))  # 8 GiB can never be had
import torch
from executor.core import Executor
import executor.check
executor.check.free_bytes = lambda device: 1 << 44  # a machine with the memory to spare
from executor.transports.local import Fabric
t0 = time.process_time()  # CPU seconds: bounded work, not wall time
try:
    Executor.load(sys.argv[1], 0, {"x": torch.zeros(8, dtype=torch.uint8)}, transport="local",
                  rendezvous=Fabric(),
                  no_identity=True)
    out = {"refused": None}
except Exception as e:
    out = {"refused": type(e).__name__, "msg": str(e)}
out["s"] = time.process_time() - t0
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


@pytest.mark.parametrize("budget", [1 << 30, 16 << 30], ids=["plan-cap", "process-cap"])
def test_8_gib_of_staging_is_refused_before_any_allocation(tmp_path, budget) -> None:
    """Staging of 8 GiB: over the plan's own options.staging_bytes (1 GiB), or, where a
    tampered header raised that to 16 GiB, over the process's cap; refused by the load
    check, never by the allocator (the child can map at most 3 GiB)."""
    path = _staging_plan(str(tmp_path / "big.rplan"), 8 << 30, budget)
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["refused"] == "PlanBoundsError", res
    assert "staging" in res["msg"] and "8589934592" in res["msg"].replace(",", "")


SPARSE_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from schemas.plan import load_rank
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.process_time()  # CPU seconds: bounded work, not wall time
try:
    load_rank(sys.argv[1], 0)
    out = {"refused": None}
except Exception as e:
    out = {"refused": type(e).__name__, "msg": str(e)[:300]}
out["s"] = time.process_time() - t0
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
print(json.dumps(out))
"""


def _sparse_plan(base: str, path: str, blob_bytes: int) -> str:
    """The plan at `base` with its `rank/0` blob declared `blob_bytes` long (the header's
    checksum recomputed), the file extended to match without writing a byte (sparse)."""
    import io
    import struct

    from schemas import plan as P

    data = open(base, "rb").read()
    raw, start = P.read_raw_header(io.BytesIO(data))
    end = max(off + n for off, n, _ in raw["blobs"].values())
    raw["blobs"]["rank/0"] = [end, blob_bytes, raw["blobs"]["rank/0"][2]]
    raw.pop("signature", None)
    head = msgpack.packb(raw, use_bin_type=True)
    with open(path, "wb") as f:
        f.write(P.MAGIC + struct.pack("<IQ", P.FORMAT_VERSION, len(head)) + head
                + P.checksum(head) + data[start:start + end])
        f.truncate(len(P.MAGIC) + 12 + len(head) + 32 + end + blob_bytes)
    return path


def test_a_sparse_plan_declaring_3_gib_is_refused_fast_and_small(bases, tmp_path) -> None:
    path = _sparse_plan(bases["cast"], str(tmp_path / "sparse.rplan"), 3 << 30)
    st = os.stat(path)
    assert st.st_size > 3 << 30 and st.st_blocks * 512 < 16 << 20  # sparse: no disk spent
    out = subprocess.run([sys.executable, "-c", SPARSE_CHILD, path], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["refused"] == "PlanFormatError", res
    assert "3,221,225,472" in res["msg"]
    assert res["s"] < 1.0 and res["rss_mb"] < 100, res  # (MB more than the imports took)
