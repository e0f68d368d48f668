"""Writing a plan file (`schemas/plan.py` has the format and the reading half).

`encode_plan` gives the file's bytes; `write_plan` writes the same bytes without holding
them: the blobs are packed as parts that leave table columns in place, written after room
for the head (whose length their lengths give), then the head (which indexes them).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from typing import Any

import msgpack

from .plan import FORMAT_VERSION, MAGIC, Plan
from .plan_codec import checksum, pack


def encode_plan(plan: Plan, key: bytes | None = None) -> bytes:
    """The bytes of a plan file; deterministic for equal plans. With `key`, the header
    carries an HMAC-SHA256 `signature` over everything (`schemas/integrity.py`)."""
    return b"".join(_encode_parts(plan, key))


def _encode_parts(plan: Plan, key: bytes | None) -> list[bytes]:
    """The plan file as its parts in order: the head (magic, version, header, digest), then
    every blob. Each blob is digested on a second thread while the next is packed (blake2b
    releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        blobs = [(name, data, pool.submit(checksum, data)) for name, data in _blobs(plan)]
        index, offset = {}, 0
        for name, data, digest in blobs:
            index[name] = [offset, len(data), digest.result()]
            offset += len(data)
    return [_head(plan, key, index)] + [data for _, data, _ in blobs]


def _head(plan: Plan, key: bytes | None, index: dict[str, list[Any]]) -> bytes:
    """Magic, version, the header (with the blob `index`, signed with `key`), its digest."""
    raw = {**plan.header.encode(), "format_version": FORMAT_VERSION, "blobs": index}
    if key is not None:
        from .integrity import signature

        raw["signature"] = signature(key, pack(raw))
    header = pack(raw)
    return MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header + checksum(header)


def _blobs(plan: Plan) -> Iterator[tuple[str, bytes]]:
    """Every blob of the plan file, packed, in file order."""
    for name, obj in _blob_objects(plan):
        yield name, pack(obj)


def _blob_objects(plan: Plan) -> Iterator[tuple[str, Any]]:
    """Every blob of the plan file as the object msgpack packs, in file order (each made
    when asked for)."""
    ids = plan.header.identities
    for r in plan.ranks:
        enc = r.encode()  # each part carries its rank's identity (schemas/identity.py)
        if "identity" not in enc and 0 <= r.rank < len(ids):
            enc["identity"] = dict(ids[r.rank])
        yield f"rank/{r.rank}", enc
    yield "explain", {"tensors": list(plan.tensors), "table": plan.explain.views()}
    yield "dag", {"nodes": plan.dag_nodes.views(), "edges": plan.dag_edges.views(),
                  "coverage": plan.coverage.views()}
    yield from plan.extra_blobs


def _parts(obj: Any) -> list[bytes | memoryview]:
    """`pack(obj)` as parts whose concatenation is those bytes, a table's column bytes left
    in place (not copied into one buffer, whose growth would hold them two or three times):
    a map is its header and its keys' and values' parts, a list of memoryviews (a table) its
    header and each column's bin header and bytes; anything else is packed whole."""
    if isinstance(obj, dict):
        out: list[bytes | memoryview] = [_PACKER.pack_map_header(len(obj))]
        for k, v in obj.items():
            out.append(pack(k))
            out += _parts(v)
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, memoryview) for v in obj):
        out = [_PACKER.pack_array_header(len(obj))]
        for v in obj:
            out += [_bin_header(v.nbytes), v]
        return out
    return [pack(obj)]


_PACKER = msgpack.Packer(use_bin_type=True)


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of `n` bytes (bin 8, 16 or 32)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _digest_parts(parts: list[bytes | memoryview]) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(part)
    return h.digest()


def write_plan(path: str, plan: Plan, key: bytes | None = None) -> int:
    """Write `plan` to `path` atomically (temp file + rename); returns the size in bytes.

    The header indexes the blobs (offsets, lengths, digests), so it is known only once all
    are digested; its length is known before: the blobs are packed first as parts (their
    table columns left in the plan's arrays, `_parts`: memory holds only the small packed
    parts, not the plan's bytes twice), which gives every blob's length, and a digest is 32
    bytes whatever it holds. So the blobs are written once, straight after a head of that
    length (digested on a second thread while packed and written), then the head in front
    of them; the file is `encode_plan`'s bytes."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    index: dict[str, list[Any]] = {}
    offset = 0
    with ThreadPoolExecutor(1) as pool:  # each blob digested while the next is packed
        blobs = []
        for name, obj in _blob_objects(plan):
            parts = _parts(obj)
            n = sum(len(part) for part in parts)
            index[name] = [offset, n, bytes(32)]  # a digest's length; its bytes come later
            offset += n
            blobs.append((name, parts, pool.submit(_digest_parts, parts)))
        at = len(_head(plan, key, index))
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.seek(at)
            for name, parts, digest in blobs:
                for part in parts:
                    f.write(part)
                index[name][2] = digest.result()
            head = _head(plan, key, index)
            if len(head) != at:  # cannot happen: msgpack sizes a 32-byte bin the same way
                raise OSError(f"write_plan: the head is {len(head)} bytes, not {at}")
            f.seek(0)
            f.write(head)
    os.replace(tmp, path)
    return len(head) + offset
