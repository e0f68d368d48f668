"""`schemas/protocol.py`, `schemas/bounds.py` and `schemas/integrity.py`: the one home of
the plan's rules, the bounds proof, per-rank digests and signing.

The plans are the fuzz's base plans (`tests/property/fuzz.py`): 3 row-split sources into 2
replicas of a 2-way column split, one block-FP8 (gathers, QUANTs) and one casting float32
to bf16 (PACKs, UNPACKs), both over several stages.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import executor
from executor.core import Executor
from executor.errors import PeerMismatchError, PlanBoundsError
from executor.quant import prepare_quants
from executor.transports.local import Fabric
from planner.tools.simulate import _Sim
from schemas.bounds import violations
from schemas.errors import PlanFormatError
from schemas.plan import COPY_COLUMNS, QUANT, UNPACK, Table, load_plan, load_rank
from schemas.plan_write import write_plan
from schemas.protocol import FP8_BLOCK, carries, copy_footprint, scale_blocks
from tests.property import fuzz
from tests.support.plans import rank_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    return fuzz.base_plans(str(tmp_path_factory.mktemp("protocol")))


def _executors(plan, world) -> list[Executor]:
    fabric = Fabric()
    exs = [Executor(plan.header, rp, world.tensors[rp.rank], transport="local", rendezvous=fabric)
           for rp in plan.ranks]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    return exs


@pytest.mark.parametrize("name", ["fp8", "cast"])
def test_the_simulator_carries_where_the_executor_does(plans, name):
    # Both take the rule from schemas.protocol.carries; for the same rank plans they hold
    # the same per-stage decisions, and the rule is not trivial on these plans.
    plan = load_plan(plans[name])
    from planner.tools.planfile import PlanRanks
    from planner.tools.simflow import load_checked

    src = PlanRanks(plan)
    sim = _Sim(src, load_checked(src), 8)
    exs = _executors(plan, fuzz._World(plan, name == "fp8"))
    for rp, ex in zip(plan.ranks, exs):
        assert ex.carries == sim.carries[rp.rank] == carries(rp).tolist()
    allowed = [c for ex in exs for c in ex.carries]
    assert any(allowed) and not all(allowed)
    # A stage that unpacks, waits for a DONE or sends an ACK never carries its writes on.
    for rp, ex in zip(plan.ranks, exs):
        c = rp.copies
        for s in np.unique(c["stage"][c["kind"] == UNPACK]).tolist():
            assert not ex.carries[s]
        assert not ex.carries[-1]


def test_a_quant_into_a_view_of_a_larger_storage_lands_in_its_region():
    # Region 1 (staging-like, 4 KiB) starts 1 KiB into a guarded storage: the e4m3 box and
    # its scales must land at offsets counted from the region, never from the storage.
    store = torch.full((8192,), 0xA5, dtype=torch.uint8)
    src = torch.randn(128, 16)
    regions = [src.reshape(-1).view(torch.uint8), store[1024:1024 + 4096]]
    row = dict.fromkeys((n for n, _ in COPY_COLUMNS), 0)
    row.update(kind=QUANT, src_region=0, src_dtype=3, src_stride0=16, src_stride1=1,
               dst_region=1, dst_dtype=4, dst_offset=512, dst_stride0=16, dst_stride1=1,
               size0=128, size1=16, size2=1, aux_offset=1000)
    copies = Table.build(COPY_COLUMNS, **{k: [v] for k, v in row.items()})
    for op in prepare_quants(copies, np.array([0]), regions):
        op()
    assert (store[:1024 + 512] == 0xA5).all() and (store[1024 + 512 + 2048:1024 + 4000] ==
                                                   0xA5).all()
    assert (store[1024 + 4004:] == 0xA5).all()
    scale = store[1024 + 4000:1024 + 4004].view(torch.float32)
    assert scale.item() == pytest.approx(src.abs().max().item() / 448, rel=1e-6)


def test_quants_of_block_aligned_parts_write_what_the_whole_box_quant_writes():
    # x is [256, 384]: 2 x 3 blocks. Quantized whole, its e4m3 rows are 384 apart and its
    # scales [2, 3]. Quantized as two column parts (0..128 and 128..384, all rows: a column
    # split), each with dst_stride0 = 384, the parts' values and scales land at the same
    # bytes: scale rows ceil(384 / 128) = 3 apart, the second part's from scale 1 on.
    x = torch.randn(256, 384)
    n_q, a = 256 * 384, 256 * 384 // 4  # scales (float32 elements) right after the values
    whole, parts = (torch.zeros(n_q + 6 * 4, dtype=torch.uint8) for _ in range(2))

    def quant(r1: int, m1: int) -> dict[str, int]:
        row = dict.fromkeys((n for n, _ in COPY_COLUMNS), 0)
        row.update(kind=QUANT, src_dtype=3, src_offset=r1, src_stride0=384, src_stride1=1,
                   dst_region=1, dst_dtype=4, dst_offset=r1, dst_stride0=384, dst_stride1=1,
                   size0=256, size1=m1, size2=1, aux_offset=a + r1 // FP8_BLOCK)
        return row

    for out, rows, scales in ((whole, [quant(0, 384)], [(a, a + 6)]),
                              (parts, [quant(0, 128), quant(128, 256)],
                               [(a, a + 3 + 1), (a + 1, a + 1 + 3 + 2)])):
        rp = rank_plan(0, "source", [], copies=rows)
        for op in prepare_quants(rp.copies, np.arange(len(rows)),
                                 [x.view(-1).view(torch.uint8), out]):
            op()
        _, _, lo, hi = copy_footprint(rp, "dst")  # each QUANT's values, then its scales
        n = len(rows)
        assert list(zip(lo[n:].tolist(), hi[n:].tolist())) == [(4 * i, 4 * j) for i, j in scales]
    assert torch.equal(parts, whole)
    assert (whole[n_q:].view(torch.float32) > 0).all()


def _rank_with_copy(plan, **values):
    rp = next(rp for rp in plan.ranks if (rp.copies["kind"] == QUANT).any())
    i = int(np.flatnonzero(rp.copies["kind"] == QUANT)[0])
    cols = {n: np.array(rp.copies[n]) for n, _ in COPY_COLUMNS}
    for k, v in values.items():
        cols[k][i] = v
    return dataclasses.replace(rp, copies=Table.build(COPY_COLUMNS, **cols)), i


def test_every_op_kind_is_bounded_even_with_size_0_dims(plans):
    plan = load_plan(plans["fp8"])
    rp, i = _rank_with_copy(plan)
    assert next(violations(rp), None) is None
    rows, _, lo, hi = copy_footprint(rp, "dst", np.array([i]))
    m, n = int(rp.copies["size0"][i]), int(rp.copies["size1"][i])
    assert sorted((hi - lo).tolist()) == sorted([m * n, 4 * scale_blocks(m, n)])
    # QUANT ignores size2: a size-0 size2 must not hide a box that reaches past staging.
    bad, _ = _rank_with_copy(plan, size2=0, size0=1 << 20)
    assert "QUANT" in next(violations(bad))
    bad, _ = _rank_with_copy(plan, aux_offset=rp.regions[-1].nbytes // 4)
    assert "past the end of its dst region" in next(violations(bad))
    bad, _ = _rank_with_copy(plan, size0=1, size1=FP8_BLOCK * 4096)
    assert next(violations(bad), None) is not None
    with pytest.raises(PlanBoundsError):
        from executor.check import check_rank_plan
        check_rank_plan(bad)


def test_plans_too_large_to_walk_are_refused_before_anything_is_built(plans, tmp_path):
    plan = load_plan(plans["cast"])
    for field, value in (("world", 2**31), ("stages", 2**20)):
        path = str(tmp_path / f"{field}.rplan")
        write_plan(path, dataclasses.replace(
            plan, header=dataclasses.replace(plan.header, **{field: value})))
        with pytest.raises(PlanFormatError, match=f"at most|world of {value}"):
            load_rank(path, 0)


def test_ranks_holding_different_plans_refuse_each_other(plans, tmp_path):
    # Rank 1's blob changed (one write 1 byte shorter), re-encoded with valid checksums and
    # the same fingerprint: its peers see its digest differ from their header's and name it.
    plan = load_plan(plans["cast"])
    rp = plan.ranks[1]
    w = {n: np.array(rp.writes[n]) for n, _ in rp.writes.schema}
    w["nbytes"][0] -= 1
    tampered = dataclasses.replace(plan, ranks=(plan.ranks[0], dataclasses.replace(
        rp, writes=Table.build(rp.writes.schema, **w)), *plan.ranks[2:]))
    path = str(tmp_path / "tampered.rplan")
    write_plan(path, tampered)
    world = fuzz._World(plan, False)
    fabric = Fabric()
    exs = [Executor(*(load_rank(path, 1) if q.rank == 1 else (plan.header, q)),
                    world.tensors[q.rank], transport="local", rendezvous=fabric)
           for q in plan.ranks]
    for ex in exs:
        ex.register()
    with pytest.raises(PeerMismatchError, match="peer rank 1 holds a different plan") as e:
        for ex in exs:
            ex.connect()
    assert e.value.peer == 1


def test_signed_plans(plans, tmp_path):
    path = plans["cast"]  # signed with fuzz.KEY
    load_plan(path, fuzz.KEY)
    key_file = tmp_path / "plan.key"
    key_file.write_bytes(fuzz.KEY)
    header, _ = load_rank(path, 0, executor.core.read_key(str(key_file)))
    assert header.signature
    with pytest.raises(PlanFormatError, match="does not match the plan key"):
        load_plan(path, b"another-key-0123456789")
    unsigned = str(tmp_path / "unsigned.rplan")
    write_plan(unsigned, load_plan(path))
    with pytest.raises(PlanFormatError, match="not signed"):
        load_plan(unsigned, fuzz.KEY)
    with pytest.raises(PlanFormatError, match="key is 16"):
        executor.core.read_key(b"short")


def test_compile_signs_with_a_key_file(tmp_path):
    key = tmp_path / "k"
    key.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    out = tmp_path / "demo.rplan"
    subprocess.run([sys.executable, "-m", "planner", "compile", str(ROOT / "plans/demo.yaml"),
                    "-o", str(out), "--sign-key", str(key)], check=True, cwd=ROOT,
                   capture_output=True)
    load_plan(str(out), executor.core.read_key(str(key)))
    load_plan(str(out), b"0123456789abcdef0123456789abcdef\n")  # the file's bytes, verbatim
    with pytest.raises(PlanFormatError, match="does not match"):
        load_plan(str(out), b"0123456789abcdef0123456789abcdef")


@pytest.mark.parametrize("key", [b"\n" + bytes(range(1, 32)), bytes(range(1, 32)) + b" ",
                                 b"\t\r" + b"k" * 30 + b"\x0b\x0c"])
def test_a_key_signed_as_bytes_loads_from_a_file_of_those_bytes(plans, tmp_path, key):
    """A random key may begin or end with whitespace bytes: os.urandom(32) does so about one
    time in twenty. Signing with the bytes and loading with a file of them must agree."""
    signed = str(tmp_path / "signed.rplan")
    write_plan(signed, load_plan(plans["cast"]), key=key)
    key_file = tmp_path / "plan.key"
    key_file.write_bytes(key)
    header, _ = load_rank(signed, 0, executor.core.read_key(str(key_file)))
    assert header.signature
