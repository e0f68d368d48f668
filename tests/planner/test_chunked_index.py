"""A chunked plan file is one signed object: its index (chunk count, order, digests,
and each target rank's whole tensor set) is covered by the signature, so a chunk dropped,
duplicated or reordered after signing is refused at load with the key, in one line; a
rank's chunks holding a tensor twice or missing one are refused at load without a key too,
and `verify` reports both."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest

from executor.chunked import ChunkedShadow, load_chunks
from executor.transports.local import Fabric
from planner.cli import main
from schemas.chunked_plan import MAGIC, load_chunked, write_chunked
from schemas.errors import PlanFormatError
from tests.support.shadow_plans import CASES, compile_chunked_file

BUDGET = 1 << 20
KEY = b"k" * 32


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> tuple[str, list]:
    d = tmp_path_factory.mktemp("chunked")
    plans = compile_chunked_file(CASES[0], BUDGET, str(d / "unsigned.rplan"))
    path = str(d / "signed.rplan")
    write_chunked(path, plans, BUDGET, KEY)
    return path, plans


def _relaid(path: str, out: Path, order: list[int], keep: dict | None = None) -> str:
    """The file at `path` with its chunks laid out in `order` (a chunk index may repeat or
    be left out), the index rewritten to match and its other fields (the signature
    included) kept, as someone without the key would."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    index = msgpack.unpackb(data[start:start + n], raw=False, strict_map_key=False)
    blobs = [data[start + n + o:start + n + o + ln] for o, ln, _ in index["chunks"]]
    at, chunks = 0, []
    for k in order:
        chunks.append([at, len(blobs[k]), index["chunks"][k][2]])
        at += len(blobs[k])
    index = dict(index, chunks=chunks, **(keep or {}))
    head = msgpack.packb(index, use_bin_type=True)
    out.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head
                    + b"".join(blobs[k] for k in order))
    return str(out)


def _target(plans) -> int:
    return next(rp.rank for rp in plans[0].ranks if rp.role == "target")


@pytest.mark.parametrize("how", ["drop chunk 1", "keep chunk 0 only", "duplicate chunk 1",
                                 "swap chunks 0 and 1"])
def test_a_signed_chunked_plan_refuses_a_changed_chunk_list_at_load_with_the_key(
        signed, tmp_path: Path, how: str) -> None:
    path, plans = signed
    n = len(plans)
    order = {"drop chunk 1": [0, *range(2, n)], "keep chunk 0 only": [0],
             "duplicate chunk 1": [0, 1, 1, *range(2, n)],
             "swap chunks 0 and 1": [1, 0, *range(2, n)]}[how]
    bad = _relaid(path, tmp_path / "bad.rplan", order)
    t = _target(plans)
    for load in (lambda: ChunkedShadow.load(bad, t, {}, transport="local", rendezvous=Fabric(),
                                            timeout_s=2,
                                            plan_key=KEY, no_identity=True),
                 lambda: load_chunks(bad, 0, {}, transport="local", rendezvous=Fabric(),
                                     timeout_s=2,
                                     plan_key=KEY, no_identity=True),
                 lambda: load_chunked(bad, KEY)):
        with pytest.raises(PlanFormatError, match="signature does not match the chunked") as e:
            load()
        assert "\n" not in str(e.value)
    # the untouched file loads with the key
    assert len(load_chunked(path, KEY)[1]) == n


def test_an_index_without_its_signature_is_refused_with_the_key(signed, tmp_path: Path
                                                                ) -> None:
    path, plans = signed
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    index = msgpack.unpackb(data[len(MAGIC) + 8:len(MAGIC) + 8 + n], raw=False,
                            strict_map_key=False)
    index.pop("signature")
    head = msgpack.packb(index, use_bin_type=True)
    bad = tmp_path / "nosig.rplan"
    bad.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + data[len(MAGIC) + 8 + n:])
    with pytest.raises(PlanFormatError, match="index is not signed"):
        load_chunked(str(bad), KEY)


def test_without_a_key_a_rank_refuses_a_duplicated_or_dropped_chunk_and_verify_says_which(
        signed, tmp_path: Path, capsys) -> None:
    path, plans = signed
    n, t = len(plans), _target(plans)
    dup = _relaid(path, tmp_path / "dup.rplan", [0, 1, 1, *range(2, n)])
    with pytest.raises(PlanFormatError, match="is also in chunk 1") as e:
        ChunkedShadow.load(dup, t, {}, transport="local", rendezvous=Fabric(), timeout_s=2,
                           no_identity=True)
    assert "\n" not in str(e.value)
    assert main(["verify", dup]) == 1
    assert "is also in chunk 1" in capsys.readouterr().err
    drop = _relaid(path, tmp_path / "drop.rplan", [0, *range(2, n)])
    with pytest.raises(PlanFormatError, match="the chunk index states") as e:
        ChunkedShadow.load(drop, t, {}, transport="local", rendezvous=Fabric(), timeout_s=2,
                           no_identity=True)
    assert "\n" not in str(e.value) and f"target rank {t}" in str(e.value)
    assert main(["verify", drop]) == 1
    assert "a chunk was dropped" in capsys.readouterr().err
    # the whole file verifies: every target byte written exactly once
    assert main(["verify", path]) == 0
