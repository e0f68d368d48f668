"""The job secret: keys derived from it, sealed store records and MACed signals.

Every process of one job gets the same secret (`executor.load(..., secret=...)` or the
environment variable `RDMA_PLAN_SECRET`; a launcher draws it once, e.g.
`python -c "import secrets; print(secrets.token_hex(32))"`, and hands it to every rank like
any other credential). From it each rank derives, with HKDF-SHA256 (RFC 5869, stdlib
`hmac`), three keys: one MACs store records, one MACs signals (keyed BLAKE2b: a signal's
MAC is on every step's path), one encrypts the bodies of
store records (a stream of keyed-BLAKE2b blocks in counter mode under a fresh 16-byte nonce,
then MACed: encrypt-then-MAC). So a process outside the job can neither read a rank's
descriptors (its NIXL agent metadata with the UCX worker address and the remote keys of
its registered memory) nor forge, move or alter a record or a signal.

What it is not: every rank holds the same secret, so it authenticates *the job*, not one
rank; a compromised rank can impersonate the others (the transport-level sender check in
`signals.py` narrows that for notifications). It does not stop a process that already holds
a region's memory keys (e.g. from an earlier run without a secret) from writing into it
one-sidedly: NIXL/UCX do not authenticate one-sided writes. See docs/reliability.md.

A record is msgpack `{"v": 1, "k": key, "r": rank, "i": incarnation, "g": generation,
"s": step, "n": nonce, "b": body, "m": mac}`; the MAC covers all of it but `m`, the store key
included, so a record cannot be moved to another key. Without a secret (`insecure=True`)
`m` is empty and `b` plain; a rank with a secret refuses such records.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ForgedRecordError, NoSecretError

log = logging.getLogger("executor")

ENV = "RDMA_PLAN_SECRET"
MIN_SECRET = 16
MAX_RECORD = 16 << 20
"""Bytes: a store value larger than this is refused before it is decoded. A rank's
descriptor record grows with its regions (over `cuda_ipc`, a source holding an MoE's
expert tensors one by one publishes megabytes: BENCHMARKS.md), and a rank has at most
`control.MAX_REGIONS` (65,536) regions."""
SIG_MAC = 16
_U64 = (1 << 64) - 1


def _hkdf(secret: bytes, info: bytes) -> bytes:
    prk = hmac.new(b"rdma-plan/v1", secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Keys:
    """The job's keys (all None when running without a secret)."""

    record: bytes | None
    signal: bytes | None
    crypt: bytes | None

    @property
    def secure(self) -> bool:
        return self.record is not None


def keys_from(secret: bytes | str | None, insecure: bool = False, rank: int = -1) -> Keys:
    """The job's keys from `secret` (else `RDMA_PLAN_SECRET`); `insecure=True` opts out."""
    if secret is None:
        secret = os.environ.get(ENV) or None
    if secret is None:
        if not insecure:
            raise NoSecretError(
                f"rank {rank}: no job secret: pass executor.load(..., secret=...) or set "
                f"{ENV} on every rank (draw it once per job: python -c \"import secrets; "
                "print(secrets.token_hex(32))\"), or pass insecure=True to run without "
                "authentication")
        log.warning("rank %d: running WITHOUT a job secret (insecure=True): any process that "
                    "reaches the rendezvous store can read memory keys and forge records "
                    "and signals", rank)
        return Keys(None, None, None)
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET:
        raise NoSecretError(f"rank {rank}: the job secret has {len(raw)} bytes, fewer than "
                        f"{MIN_SECRET}; draw one with secrets.token_hex(32)")
    return Keys(_hkdf(raw, b"record"), _hkdf(raw, b"signal"), _hkdf(raw, b"crypt"))


def _stream(key: bytes, nonce: bytes, data: bytes) -> bytes:
    """XOR `data` with keyed-BLAKE2b(key, nonce || counter) blocks of 64 bytes (its own
    inverse; far faster in Python than HMAC-SHA256 blocks XORed byte by byte)."""
    if not data:
        return b""
    mac = hashlib.blake2b(key=key, digest_size=64)
    blocks = []
    for i in range(-(-len(data) // 64)):
        h = mac.copy()
        h.update(nonce + struct.pack("<Q", i))
        blocks.append(h.digest())
    pad = b"".join(blocks)[:len(data)]
    n = len(data)
    return (int.from_bytes(data, "little") ^ int.from_bytes(pad, "little")).to_bytes(n, "little")


def _mac_input(rec: dict[str, Any]) -> bytes:
    return msgpack.packb([rec["v"], rec["k"], rec["r"], rec["i"], rec["g"], rec["s"],
                          rec["n"], rec["b"]])


@dataclass(frozen=True, slots=True)
class Record:
    """A store record, opened: who wrote it (rank, incarnation, generation), its step, body."""

    rank: int
    inc: int
    gen: int
    step: int
    body: Any


def seal(keys: Keys, key: str, rank: int, inc: int, gen: int, step: int, body: Any,
         encrypt: bool = True) -> bytes:
    """The store value of `body` (msgpack-able) at `key`, written by rank `rank`."""
    plain = msgpack.packb(body)
    nonce = os.urandom(16)
    rec = {"v": 1, "k": key, "r": rank, "i": inc, "g": gen, "s": step, "n": nonce,
           "b": plain, "m": b""}
    if keys.secure:
        if encrypt:
            rec["b"] = _stream(keys.crypt, nonce, plain)  # type: ignore[arg-type]
        rec["m"] = hmac.new(keys.record, _mac_input(rec), hashlib.sha256).digest()  # type: ignore[arg-type]
    return msgpack.packb(rec)


def open_record(keys: Keys, key: str, raw: object, rank: int, encrypted: bool = True) -> Record:
    """Check and open the store value at `key` that rank `rank` should have written.

    Raises `ForgedRecordError` naming the key and what is wrong (not a record, oversized,
    unsigned, bad MAC, written for another key or by another rank, fields out of range)."""
    def bad(why: str) -> ForgedRecordError:
        return ForgedRecordError(f"store record {key!r}: {why}; it was not written by rank "
                                 f"{rank} of this job (refused)", key=key)

    if not isinstance(raw, (bytes, bytearray)):
        raise bad(f"a {type(raw).__name__}, not bytes")
    if len(raw) > MAX_RECORD:
        raise bad(f"{len(raw)} bytes, over the {MAX_RECORD}-byte limit")
    try:
        rec = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True,
                              max_bin_len=MAX_RECORD, max_str_len=4096, max_array_len=64,
                              max_map_len=16, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - any decoding failure is garbage
        raise bad(f"not a record ({type(e).__name__})") from None
    fields = {"v": int, "k": str, "r": int, "i": int, "g": int, "s": int, "n": bytes,
              "b": bytes, "m": bytes}
    if not isinstance(rec, dict) or set(rec) != set(fields) or not all(
            isinstance(rec[f], t) and not isinstance(rec[f], bool) for f, t in fields.items()):
        raise bad("not a record (fields or types)")
    if keys.secure:
        if not rec["m"]:
            raise bad("unsigned (written without the job secret)")
        want = hmac.new(keys.record, _mac_input(rec), hashlib.sha256).digest()
        if not hmac.compare_digest(want, rec["m"]):
            raise bad("its MAC does not match (forged, altered or another job's secret)")
    if rec["v"] != 1 or rec["k"] != key:
        raise bad(f"written for key {rec['k']!r} (version {rec['v']}): moved or replayed")
    if rec["r"] != rank:
        raise bad(f"claims rank {rec['r']}")
    for f, hi in (("i", _U64), ("g", 1 << 62), ("s", 1 << 62)):
        if not 0 <= rec[f] <= hi:
            raise bad(f"field {f!r} = {rec[f]} out of range [0, {hi}]")
    body = rec["b"]
    if keys.secure and encrypted:
        body = _stream(keys.crypt, rec["n"], body)  # type: ignore[arg-type]
    try:
        value = msgpack.unpackb(body, raw=False, max_bin_len=MAX_RECORD, max_ext_len=0,
                                max_array_len=1 << 16, max_map_len=64, max_str_len=1 << 16)
    except Exception as e:  # noqa: BLE001
        raise bad(f"its body is not msgpack ({type(e).__name__})") from None
    return Record(rec["r"], rec["i"], rec["g"], rec["s"], value)


@functools.lru_cache(maxsize=16)
def _signal_mac(key: bytes) -> Any:
    """Keyed BLAKE2b of `key`, 16-byte digests, made once (each MAC copies it: several
    times cheaper than an HMAC-SHA256, and a MAC is made four times per stage on a step's
    path)."""
    return hashlib.blake2b(key=key, digest_size=SIG_MAC)


def signal_mac(keys: Keys) -> Any:
    """The keyed BLAKE2b a signal's MAC copies (None without a secret): held by whoever
    seals or checks signals on a step's path (no cache lookup a message)."""
    return _signal_mac(keys.signal) if keys.secure else None  # type: ignore[arg-type]


def _mac(key: bytes, msg: bytes) -> bytes:
    h = _signal_mac(key).copy()
    h.update(msg)
    return h.digest()


def sign(keys: Keys, msg: bytes) -> bytes:
    """`msg` + its MAC (16 bytes of keyed BLAKE2b; zeros without a secret)."""
    if not keys.secure:
        return msg + bytes(SIG_MAC)
    return msg + _mac(keys.signal, msg)  # type: ignore[arg-type]


def verify(keys: Keys, signed: bytes) -> bool:
    """Whether the MAC at the end of `signed` is right (always True without a secret)."""
    if not keys.secure:
        return True
    return hmac.compare_digest(_mac(keys.signal, signed[:-SIG_MAC]),  # type: ignore[arg-type]
                               signed[-SIG_MAC:])
