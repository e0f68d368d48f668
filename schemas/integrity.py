"""Plan integrity: per-rank digests that peers compare, and optional signing.

- `rank_digest(header, rank)`: the blake2b-256 of rank `rank`'s blob, from the header's
  index. Every rank publishes the digest of its own blob at connect and checks each peer's
  against its own header (`executor/core.py`): ranks holding different or tampered plans
  refuse each other, naming the rank.
- Signing: `rdma-plan compile --sign-key FILE` stores `signature` = HMAC-SHA256(key, the
  header map without `signature`, msgpack) in the header. The header holds every blob's
  digest, so the signature covers the whole plan. `executor.load(..., plan_key=...)` refuses
  an unsigned or wrongly signed plan. A key is bytes, or the path of a file holding them
  (at least 16 bytes; e.g. `head -c 32 /dev/urandom > plan.key`). A file's bytes are the key
  verbatim, whitespace and newlines included, so signing with the bytes and loading with the
  file agree whatever the bytes are.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import msgpack

from .errors import PlanFormatError
from .header import PlanHeader

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 1 << 16


def rank_digest(header: PlanHeader, rank: int) -> bytes:
    """The digest of rank `rank`'s blob (empty for a plan without that blob)."""
    entry = header.blobs.get(f"rank/{rank}")
    return b"" if entry is None else entry.digest


def plan_key(key: bytes | str | os.PathLike[str]) -> bytes:
    """A signing key: the bytes themselves, or the contents of the file at a path."""
    if isinstance(key, (str, os.PathLike)):
        from .safe_read import open_regular

        fix = "give the key file the plan was signed with (e.g. head -c 32 /dev/urandom > plan.key)"
        try:
            with open_regular(key, "plan key file", fix, PlanFormatError) as f:
                data = f.read(MAX_KEY_BYTES + 1)
        except OSError as e:
            raise PlanFormatError(f"plan key file {str(key)!r}: cannot be read "
                                  f"({e.strerror}); {fix}") from None
        key = data  # verbatim: a file holding the bytes a caller signed with is that key
    if not isinstance(key, bytes) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        size = len(key) if isinstance(key, bytes) else type(key).__name__
        raise PlanFormatError(f"plan key: {size} bytes; a key is {MIN_KEY_BYTES} to "
                              f"{MAX_KEY_BYTES} bytes (e.g. head -c 32 /dev/urandom > plan.key)")
    return key


def signature(key: bytes, unsigned_header: bytes) -> bytes:
    """HMAC-SHA256 of the msgpack bytes of the header map without `signature`."""
    return hmac.new(plan_key(key), unsigned_header, hashlib.sha256).digest()


def check_signature(raw_header: dict[str, Any], key: bytes, path: str = "plan") -> None:
    """Raise `PlanFormatError` unless the header map is signed with `key`."""
    sig = raw_header.get("signature")
    if not sig:
        raise PlanFormatError(f"{path}: the plan is not signed, but a plan key was given; "
                              "compile it with `rdma-plan compile --sign-key FILE`")
    unsigned = {k: v for k, v in raw_header.items() if k != "signature"}
    want = signature(key, msgpack.packb(unsigned, use_bin_type=True))
    if not isinstance(sig, bytes) or not hmac.compare_digest(sig, want):
        raise PlanFormatError(f"{path}: the plan's signature does not match the plan key; it "
                              "was changed after signing or signed with another key: "
                              "recompile and sign it with this key")
