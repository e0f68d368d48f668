"""The plan file's codec, beneath `schemas.plan`: plain msgpack in and out (no extension
type, no timestamp: loading a plan runs no code), blake2b-256 digests, reads within
bounds (a declared size is never allocated before the file is shown to hold its bytes, and
is read `CHUNK` at a time with its digest computed as it arrives), and the compact form of
a blob (`deflate`/`inflate`: a raw deflate stream (a zlib one in version 3 files), its
decoded size declared and bounded by its stored size)."""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

import msgpack

from .errors import PlanFormatError


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_PLAIN = (dict, list, str, bytes, int, float, bool, type(None))


def _no_ext(code: int, data: bytes) -> Any:
    raise PlanFormatError(f"msgpack extension type {code} is not allowed in a plan")


def unpack(data: bytes, what: str) -> Any:
    """Plain msgpack data only: extension types (and timestamps) are refused. Data with no
    extension value passes a C-level `max_ext_len=0` decode and skips the walk below."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext,
                               max_ext_len=0)
    except (ValueError, TypeError, PlanFormatError):  # an extension, or corrupt: see below
        pass  # the full decode below says which
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except PlanFormatError as e:
        raise PlanFormatError(f"{what}: {e}") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for corrupt input
        raise PlanFormatError(f"{what}: not valid msgpack ({type(e).__name__})") from None
    todo = [obj]
    while todo:  # msgpack decodes ext type -1 (timestamp) without calling ext_hook
        o = todo.pop()
        if not isinstance(o, _PLAIN):
            raise PlanFormatError(f"{what}: a {type(o).__name__} value is not allowed in a plan "
                                  "(plain msgpack only)")
        if isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, list):
            todo.extend(o)
    return obj


def check_plain(data: bytes, what: str) -> None:
    """What `unpack` checks of `data`, nothing kept: arrays made as tuples, which cost less
    than lists (`use_list` changes only the container made: map keys must be strings
    either way, so the same bytes pass), and anything the fast decode refuses handed to
    `unpack`, which accepts exactly what it accepts and says what is wrong."""
    try:
        msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext,
                        max_ext_len=0, use_list=False)
        return
    except (ValueError, TypeError, PlanFormatError):  # what `unpack`'s own fast decode
        pass  # hands on: `unpack` decides, and says what is wrong
    unpack(data, what)


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


MAX_HEADER_BYTES = 64 << 20
"""Largest plan header read (a world of 65,536 ranks indexes its blobs in a few MB)."""
CHUNK = 16 << 20
"""Bytes read at a time: a declared size is never allocated before its bytes are there."""


def _stored(f: BinaryIO, start: int, n: int) -> int:
    """Bytes of `[start, start + n)` the file really holds before its first hole (a sparse
    file reads zeros there without storing them: its size is no proof of its bytes)."""
    import os

    try:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if start + n > size:
            return max(0, size - start)
        raw = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            hole = os.lseek(fd, start, os.SEEK_HOLE)
        finally:
            os.lseek(fd, raw, os.SEEK_SET)  # where the buffered reader left it
        return min(n, max(0, hole - start))
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return n


def read_exact(f: BinaryIO, n: int, what: str, digest: bytes | None = None) -> bytes:
    """`n` bytes from `f`, refused before anything is allocated unless the file holds them
    (no hole, not past its end), read `CHUNK` at a time; with `digest`, their blake2b-256
    computed as they arrive and compared at the end."""
    at = f.tell()
    have = _stored(f, at, n)
    if have < n:
        raise PlanFormatError(f"{what}: declares {n:,} bytes at offset {at:,} but the file "
                              f"holds {have:,} there (truncated, or sparse: a hole reads as "
                              "zeros); the file is corrupt")
    h = hashlib.blake2b(digest_size=32) if digest is not None else None
    parts = []
    left = n
    while left:
        part = f.read(min(left, CHUNK))
        if not part:
            raise PlanFormatError(f"{what}: file is truncated (wanted {n} bytes, got "
                                  f"{n - left})")
        if h is not None:
            h.update(part)
        parts.append(part)
        left -= len(part)
    if h is not None and h.digest() != digest:
        raise PlanFormatError(f"{what}: checksum mismatch; the file is corrupt")
    return parts[0] if len(parts) == 1 else b"".join(parts)


FRAME = b"\xc1D"
"""The start of a compact blob: 0xC1, the one byte msgpack never uses (so no plain blob
starts with it), then the codec, `D` (a raw deflate stream: no zlib header, nor its Adler-32
of the decoded bytes, which the blob's blake2b of its stored bytes already covers); a u64
decoded size follows, then the stream."""
ZLIB_FRAME = b"\xc1Z"
"""The codec of version 3 files, read still: the same, the stream a zlib one (`LEVEL`)."""
CODECS = {FRAME: -15, ZLIB_FRAME: 15}
"""Each codec's `wbits` for zlib: raw deflate, zlib."""
FRAME_HEAD = len(FRAME) + 8
LEVEL = 2
"""zlib's level: op tables are runs of equal strides, which zlib's fast levels (1-3) already
shrink many times over. Level 2 looks for longer matches than level 1 and so, on such
tables, takes fewer steps: it compresses the largest plans faster than level 1 and smaller
(BENCHMARKS.md); decoding costs about the same at any level."""
MAX_RATIO = 1032
"""Deflate's largest expansion (a 258-byte match per 2 bits, plus block headers): a stream of
`n` bytes cannot decode to more than `MAX_RATIO * n + 64`."""
MAX_DECODED = 1 << 36
"""Largest decoded blob (64 GiB): far above any real plan's blobs (hundreds of MB)."""


def deflate(parts: Iterable[bytes | memoryview]) -> bytes:
    """The compact blob of the bytes `parts` join to (compressed part by part: they are never
    joined), framed: `FRAME`, the decoded size, the raw deflate stream."""
    z = zlib.compressobj(LEVEL, zlib.DEFLATED, CODECS[FRAME])
    out = [b""]
    n = 0
    for part in parts:
        n += len(part)
        out.append(z.compress(part))
    out.append(z.flush())
    out[0] = FRAME + struct.pack("<Q", n)
    return b"".join(out)


def inflate(data: bytes, what: str) -> bytes:
    """A blob's msgpack bytes: a plain blob as it is, a compact one (`FRAME`) decoded. The
    declared size is checked against what the stream's own size allows (deflate expands at
    most `MAX_RATIO` times) and `MAX_DECODED` before anything is decoded, and at most that
    many bytes (plus one) are ever produced: a stream that decodes to more or less, or that
    has bytes after its end, is refused."""
    if data[:1] != FRAME[:1]:
        return data
    wbits = CODECS.get(bytes(data[:2]))
    if wbits is None or len(data) < FRAME_HEAD:
        raise PlanFormatError(f"{what}: unknown blob codec {data[:2]!r} (this build reads "
                              f"raw deflate, {FRAME!r}, and zlib, {ZLIB_FRAME!r}); the file "
                              "is corrupt or from a newer version")
    (n,) = struct.unpack_from("<Q", data, len(FRAME))
    stored = len(data) - FRAME_HEAD
    if n > MAX_RATIO * stored + 64 or n > MAX_DECODED:
        raise PlanFormatError(f"{what}: declares {n:,} decoded bytes from a {stored:,}-byte "
                              f"stream (at most {min(MAX_RATIO * stored + 64, MAX_DECODED):,});"
                              " the file is corrupt")
    z = zlib.decompressobj(wbits)
    try:
        out = z.decompress(memoryview(data)[FRAME_HEAD:], n + 1)
    except zlib.error as e:
        raise PlanFormatError(f"{what}: compact blob does not decode ({e}); the file is "
                              "corrupt") from None
    if len(out) != n or not z.eof or z.unconsumed_tail or z.unused_data:
        raise PlanFormatError(f"{what}: compact blob decodes to {len(out):,}"
                              f"{'+' if z.unconsumed_tail else ''} bytes"
                              f"{'' if z.eof else ' (its stream does not end)'}"
                              f"{' and has bytes after its end' if z.unused_data else ''}, "
                              f"not the {n:,} it declares; the file is corrupt")
    return out
