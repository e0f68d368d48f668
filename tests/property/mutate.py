"""Mutations of plan files, raw and semantic, for property 9.

Raw mutations change the file's bytes (bit flips, truncation, appended bytes, the
version and header-length fields, the magic): the checksums or the framing catch them.
Semantic mutations change one value of a decoded plan (a column of one rank's writes,
batches, copies, signals or waits; a region; the stage count; the peer region sizes; a
dropped or duplicated row; the fingerprint) and re-encode it with valid checksums, so
that the executor's own checks (`executor/check.py`, `bind`) are what must stop it.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from schemas.plan import Plan, RankPlan, Region, Table
from schemas.plan_write import encode_plan

TABLES = ("writes", "batches", "copies", "signals", "waits")
Mutation = tuple[str, Callable[[bytes, Plan], bytes]]


def _interesting(draw: st.DrawFn, old: int, limit: int, dtype: np.dtype) -> int:
    info = np.iinfo(dtype)
    value = draw(st.one_of(
        st.sampled_from([-1, 0, 1, 2, 63, 64, 2**31 - 1, 2**31, 2**32, 2**40, 2**60,
                         2**62, 2**63 - 1, -(2**63), limit, limit + 1, limit - 1]),
        st.integers(old - 3, old + 3), st.integers(-(2**63), 2**63 - 1)))
    return int(min(max(value, info.min), info.max))


def _table(t: Table, row: int, col: str, value: int) -> Table:
    cols = {n: np.array(t[n]) for n, _ in t.schema}
    cols[col][row] = value
    return Table.build(t.schema, **cols)


def _rows(t: Table, keep: np.ndarray) -> Table:
    return Table.build(t.schema, **{n: np.array(t[n])[keep] for n, _ in t.schema})


@st.composite
def raw_mutation(draw: st.DrawFn, size: int) -> Mutation:
    kind = draw(st.sampled_from(["flip", "truncate", "append", "version", "header_len",
                                 "magic"]))
    if kind == "flip":
        flips = draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 7)),
                              min_size=1, max_size=4))

        def flip(data: bytes, _: Plan) -> bytes:
            out = bytearray(data)
            for pos, bit in flips:
                out[pos] ^= 1 << bit
            return bytes(out)
        return f"flip bits {flips}", flip
    if kind == "truncate":
        n = draw(st.integers(0, size - 1))
        return f"truncate to {n} bytes", lambda data, _: data[:n]
    if kind == "append":
        extra = draw(st.binary(min_size=1, max_size=64))
        return f"append {extra!r}", lambda data, _: data + extra
    if kind == "version":
        v = draw(st.integers(0, 2**32 - 1).filter(lambda v: v != 1))
        return f"version {v}", lambda data, _: data[:8] + struct.pack("<I", v) + data[12:]
    if kind == "header_len":
        n = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, size)))
        return f"header length {n}", lambda data, _: data[:12] + struct.pack("<Q", n) + \
            data[20:]
    magic = draw(st.binary(min_size=8, max_size=8))
    return f"magic {magic!r}", lambda data, _: magic + data[8:]


@st.composite
def semantic_mutation(draw: st.DrawFn, plan: Plan) -> Mutation:
    r = draw(st.integers(0, len(plan.ranks) - 1))
    rp = plan.ranks[r]
    tables = [t for t in TABLES if len(getattr(rp, t))]
    kinds = ["peer_regions", "fingerprint", "rank", "role", "stages"]
    kinds += ["region"] if rp.regions else []
    kinds += ["value"] * 6 + ["drop_row", "dup_row"] if tables else []
    kind = draw(st.sampled_from(kinds))
    what = f"rank {r}: {kind}"
    new_rank: Callable[[RankPlan], RankPlan]
    header = plan.header
    if kind == "value":
        name = draw(st.sampled_from(tables))
        t: Table = getattr(rp, name)
        row = draw(st.integers(0, len(t) - 1))
        col, dt = draw(st.sampled_from(t.schema))
        limit = max((reg.nbytes for reg in rp.regions), default=0)
        value = _interesting(draw, int(t[col][row]), limit, np.dtype(dt))
        what += f" {name}[{row}].{col} = {value} (was {int(t[col][row])})"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, **{name: _table(getattr(p, name), row, col, value)})
    elif kind in ("drop_row", "dup_row"):
        name = draw(st.sampled_from(tables))
        n = len(getattr(rp, name))
        row = draw(st.integers(0, n - 1))
        keep = np.delete(np.arange(n), row) if kind == "drop_row" else \
            np.insert(np.arange(n), row, row)
        what += f" {name} row {row}"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, **{name: _rows(getattr(p, name), keep)})
    elif kind == "stages":
        value = draw(st.sampled_from([0, rp.stages + 1, 2**20, 2**40, 2**62, -1]))
        what += f" = {value}"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, stages=value)
    elif kind == "region":
        i = draw(st.integers(0, len(rp.regions) - 1))
        reg = rp.regions[i]
        field = draw(st.sampled_from(["nbytes", "shape", "dtype", "name"]))
        if field == "nbytes":
            new = dataclasses.replace(reg, nbytes=draw(st.sampled_from(
                [0, reg.nbytes - 1, reg.nbytes + 1, reg.nbytes * 2, 2**40, -1])))
        elif field == "shape":
            new = dataclasses.replace(reg, shape=tuple(draw(st.lists(
                st.integers(0, 64), max_size=3))))
        elif field == "dtype":
            new = dataclasses.replace(reg, dtype=draw(st.sampled_from(
                ["uint8", "bfloat16", "float16", "float32", "float8_e4m3fn", "int64",
                 "complex64", "nonsense"])))
        else:
            new = dataclasses.replace(reg, name=draw(st.sampled_from(
                ["__staging__", "", "x" * 300, reg.name + "_"])))
        what += f" {i} {field}: {new}"

        def new_rank(p: RankPlan) -> RankPlan:
            regions: list[Region] = list(p.regions)
            regions[i] = new
            return dataclasses.replace(p, regions=tuple(regions))
    elif kind == "peer_regions":
        scale = draw(st.sampled_from([0, 2, -1]))
        what += f" sizes x {scale}"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, peer_regions=tuple(
                (peer, tuple((r, n * scale) for r, n in sizes)) for peer, sizes in p.peer_regions))
    elif kind == "rank":
        value = draw(st.sampled_from([-1, len(plan.ranks), 2**40, (r + 1) % len(plan.ranks)]))
        what += f" = {value}"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, rank=value)
    elif kind == "role":
        role = draw(st.sampled_from(["source", "target", "bogus"]))
        what += f" = {role}"

        def new_rank(p: RankPlan) -> RankPlan:
            return dataclasses.replace(p, role=role)
    else:
        fp = draw(st.sampled_from(["", "0" * 32, "not hex", "f" * 1000]))
        what = f"fingerprint = {fp!r}"
        header = dataclasses.replace(plan.header, fingerprint=fp)

        def new_rank(p: RankPlan) -> RankPlan:
            return p

    def apply(_: bytes, base: Plan) -> bytes:
        ranks = list(base.ranks)
        ranks[r] = new_rank(ranks[r])
        return encode_plan(dataclasses.replace(base, header=header, ranks=tuple(ranks)))
    return what, apply
