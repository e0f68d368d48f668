"""The compact plan file: every blob a raw deflate stream of its msgpack bytes (a zlib
stream in version 3 files, still read), its decoded size declared and bounded by its stored
size. Both forms of every shipped config decode to the same plan, op by op; a version 2
(plain) file is still read; a compact blob that lies about its size, or would decode past
what its stream allows, is refused before it is decoded."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from planner.compiler import compile_config
from planner.validate import load
from schemas import plan as P
from schemas.integrity import rank_digest
from schemas.plan_codec import FRAME, MAX_RATIO, ZLIB_FRAME, checksum, deflate, inflate, pack
from schemas.plan_write import encode_plan, write_plan
from tests.support.shipped import CONFIGS, shipped_param

ROOT = Path(__file__).resolve().parents[2]
QUICK = {"demo.yaml", "demo-moe.yaml", "qwen3-8b_megatron-tp2_vllm-tp2.yaml",
         "qwen3-8b_megatron-tp4pp2_vllm-tp2x4.yaml", "qwen3-30b-a3b_megatron-ep8_vllm-tp2-ep.yaml",
         "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml",
         "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4_fp8.yaml", "qwen3-4b_dp8_to_vllm-dp8.yaml",
         "qwen3-4b_dp8_to_vllm-tp8.yaml", "qwen3-4b_pp2dp4_to_vllm-tp4dp2.yaml"}
"""Configs that compile in a few seconds (the rest, up to DeepSeek-V3's 8 M writes, are in
the opt-in profile, `-m extended`)."""
RANK_TABLES = ("writes", "batches", "copies", "signals", "waits")


def _same_rank(a: P.RankPlan, b: P.RankPlan, what: str) -> None:
    """Equal op by op: every table's columns (dtype and values; the first differing row
    named), then everything else the part holds, byte for byte as msgpack packs it."""
    for name in RANK_TABLES:
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.schema == tb.schema and len(ta) == len(tb), f"{what}.{name}: shape differs"
        for (col, _), ca, cb in zip(ta.schema, ta.columns, tb.columns):
            assert ca.dtype == cb.dtype, f"{what}.{name}.{col}: dtype differs"
            bad = np.flatnonzero(ca != cb)
            assert not len(bad), f"{what}.{name}[{bad[0]}].{col}: {ca[bad[0]]} != {cb[bad[0]]}"
    assert pack(a.encode()) == pack(b.encode()), f"{what}: part differs"


def _blob(path: Path, name: str) -> object:
    with P.open_plan(str(path)) as f:
        header, start = P.read_header(f, str(path))
        return P.read_blob(f, header, start, name, str(path))


@pytest.mark.parametrize("config", [shipped_param(p, QUICK) for p in CONFIGS])
def test_both_forms_of_a_shipped_plan_decode_alike(config: Path, tmp_path: Path) -> None:
    plan = compile_config(*load(str(config)))
    compact, plain = tmp_path / "c.rplan", tmp_path / "p.rplan"
    write_plan(str(compact), plan)
    write_plan(str(plain), plan, compact=False)
    with P.open_plan(str(compact)) as f:
        names = list(P.read_header(f, str(compact))[0].blobs)
    assert names == list(P.load_rank(str(plain), 0)[0].blobs)
    for r, rp in enumerate(plan.ranks):
        hc, c = P.load_rank(str(compact), r)
        hp, p = P.load_rank(str(plain), r)
        _same_rank(c, p, f"rank/{r} (compact vs plain)")
        ids = plan.header.identities
        if rp.identity is None and ids:  # the writer puts each rank's identity in its part
            rp = dataclasses.replace(rp, identity=dict(ids[r]))
        _same_rank(c, rp, f"rank/{r} (compact vs compiled)")
        assert hc.fingerprint == hp.fingerprint == plan.header.fingerprint
    for name in names:
        if not name.startswith("rank/"):
            assert pack(_blob(compact, name)) == pack(_blob(plain, name)), name
    assert compact.stat().st_size < plain.stat().st_size


def _demo() -> P.Plan:
    return compile_config(*load(str(ROOT / "plans/demo.yaml")))


def test_compact_blobs_are_framed_and_signed(tmp_path: Path) -> None:
    """Every stored blob is a frame; the index digests (and so the signature and the digests
    peers compare) are those of the compact bytes; a flipped byte inside a stream is
    refused by its digest."""
    plan = _demo()
    data = encode_plan(plan, b"k" * 32)
    path = tmp_path / "s.rplan"
    path.write_bytes(data)
    with P.open_plan(str(path)) as f:
        header, start = P.read_header(f, str(path), key=b"k" * 32)
        for name, e in header.blobs.items():
            stored = data[start + e.offset:start + e.offset + e.length]
            assert stored[:2] == FRAME and checksum(stored) == e.digest, name
        assert rank_digest(header, 0) == header.blobs["rank/0"].digest
    e = header.blobs["rank/0"]
    bad = bytearray(data)
    bad[start + e.offset + e.length - 5] ^= 1
    path.write_bytes(bytes(bad))
    with pytest.raises(P.PlanFormatError, match="checksum"):
        P.load_rank(str(path), 0)


def _with_blob(plan: P.Plan, tmp_path: Path, name: str, stored: bytes) -> Path:
    """The plain file of `plan` with blob `name` replaced by `stored`, indexed and digested
    (as a forger would): only the blob's own checks can refuse it."""
    index, blobs, offset = {}, [], 0
    from schemas.plan_write import _blob_objects, _head

    for n, obj in _blob_objects(plan):
        b = stored if n == name else pack(obj)
        index[n] = [offset, len(b), checksum(b)]
        blobs.append(b)
        offset += len(b)
    path = tmp_path / "forged.rplan"
    path.write_bytes(_head(plan, None, index) + b"".join(blobs))
    return path


def _frame(n: int, stream: bytes) -> bytes:
    return FRAME + struct.pack("<Q", n) + stream


def _raw_deflate(data: bytes, level: int = 6) -> bytes:
    z = zlib.compressobj(level, zlib.DEFLATED, -15)
    return z.compress(data) + z.flush()


def test_a_compact_blob_that_lies_about_its_size_is_refused(tmp_path: Path) -> None:
    plan = _demo()
    raw = pack(_blob_objects_rank0(plan))
    stream = _raw_deflate(raw)
    assert P.load_rank(str(_with_blob(plan, tmp_path, "rank/0", _frame(len(raw), stream))),
                       0)[1].rank == 0  # the honest frame loads
    for n, why in ((len(raw) - 1, "decodes to"), (len(raw) + 1, "decodes to"),
                   (MAX_RATIO * len(stream) + 65, "at most")):
        path = _with_blob(plan, tmp_path, "rank/0", _frame(n, stream))
        with pytest.raises(P.PlanFormatError, match=why):
            P.load_rank(str(path), 0)
    honest = _frame(len(raw), stream)
    for stored, why in ((_frame(len(raw), stream + b"x"), "after its end"),
                        (_frame(len(raw), stream[:-3]), "does not (decode|end)"),
                        (_frame(len(raw), b"\x00" + stream), "does not decode"),
                        (b"\xc1Q" + honest[2:], "unknown blob codec"),
                        (b"\xc1Z\x00", "unknown blob codec")):
        path = _with_blob(plan, tmp_path, "rank/0", stored)
        with pytest.raises(P.PlanFormatError, match=why):
            P.load_rank(str(path), 0)


def _blob_objects_rank0(plan: P.Plan) -> object:
    from schemas.plan_write import _blob_objects

    return next(obj for n, obj in _blob_objects(plan) if n == "rank/0")


def test_a_bomb_is_refused_before_it_is_decoded() -> None:
    """1 GiB of zeros deflates to about 1 MB: declared truthfully it is within what deflate
    allows, but the cap is checked before decoding, and a declared size the stream cannot
    reach is refused at once (nothing decoded: no allocation of the declared size)."""
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(1 << 20)
    stream = b"".join(z.compress(chunk) for _ in range(64)) + z.flush()  # 64 MiB of zeros
    with pytest.raises(P.PlanFormatError, match="at most"):
        inflate(_frame(1 << 40, stream), "blob")
    assert len(inflate(_frame(64 << 20, stream), "blob")) == 64 << 20
    assert inflate(deflate([b"ab", memoryview(b"cd")]), "blob") == b"abcd"
    assert inflate(b"\x90", "blob") == b"\x90"  # a plain blob passes as it is


def test_a_version_3_zlib_blob_is_still_read() -> None:
    """A version 3 compact blob (`ZLIB_FRAME`, a zlib stream, its Adler-32 checked) decodes;
    the same stream framed as raw deflate does not, nor a raw stream framed as zlib."""
    data = pack({"a": list(range(300))})
    assert inflate(ZLIB_FRAME + struct.pack("<Q", len(data)) + zlib.compress(data), "b") == data
    with pytest.raises(P.PlanFormatError, match="does not decode"):
        inflate(_frame(len(data), zlib.compress(data)), "b")
    with pytest.raises(P.PlanFormatError, match="does not decode"):
        inflate(ZLIB_FRAME + struct.pack("<Q", len(data)) + _raw_deflate(data), "b")
    assert deflate([data])[:2] == FRAME and inflate(deflate([data]), "b") == data


def test_a_version_2_plan_is_still_read(tmp_path: Path) -> None:
    """A version 2 file (every blob plain, the header saying 2) loads as the same plan."""
    plan = _demo()
    plain = encode_plan(plan, compact=False)
    path = tmp_path / "v3.rplan"
    path.write_bytes(plain)
    with P.open_plan(str(path)) as f:
        raw, start = P.read_raw_header(f, str(path))
    raw["format_version"] = 2
    head = pack(raw)
    old = tmp_path / "v2.rplan"
    old.write_bytes(P.MAGIC + struct.pack("<IQ", 2, len(head)) + head + checksum(head)
                    + plain[start:])
    for r in range(len(plan.ranks)):
        _same_rank(P.load_rank(str(old), r)[1], P.load_rank(str(path), r)[1], f"rank/{r}")
    assert len(P.load_plan(str(old)).ranks) == len(plan.ranks)
    old.write_bytes(P.MAGIC + struct.pack("<IQ", 1, len(head)) + head + checksum(head)
                    + plain[start:])
    with pytest.raises(P.PlanFormatError, match="version 1 is not supported"):
        P.load_rank(str(old), 0)


def test_a_rank_decodes_only_its_own_part(tmp_path: Path) -> None:
    """A bomb in rank 1's blob does not stop rank 0 from loading: a rank reads, inflates and
    checks its own blob only; rank 1 (and a whole-plan read) refuse it."""
    plan = _demo()
    path = _with_blob(plan, tmp_path, "rank/1", _frame(1 << 40, _raw_deflate(bytes(1 << 16))))
    assert P.load_rank(str(path), 0)[1].rank == 0
    for read in (lambda: P.load_rank(str(path), 1), lambda: P.load_plan(str(path))):
        with pytest.raises(P.PlanFormatError, match="rank/1.*at most"):
            read()
