"""An engine's expert placement: per MoE layer, which logical expert each physical slot holds.

vLLM's EPLB (`EplbState.physical_to_logical_map`) and SGLang's (`ExpertLocationMetadata.
physical_to_logical_map`) both keep it as one integer table `[moe layers, physical experts]`:
row `l` is the `l`-th MoE layer of the model (in layer order), column `s` the physical expert
slot (EP rank `r` holds slots `[r*P/ep, (r+1)*P/ep)`), the value the logical expert whose
weights that slot holds. With redundant experts `P > E` and some logical experts sit in
several slots; every logical expert sits in at least one. The same table is what the plan's
target layout is built from, and what a backend compares with the engine's at each update.

Files (`target.placement: PATH`, or an engine's dump): JSON or msgpack of a map
`{"physical_to_logical_map": [[...], ...]}` (vLLM's and SGLang's name for it); the table may
also be given inline in the YAML under `target.placement.physical_to_logical_map`.
No torch here: the planner and `inspect` read placements on a login node.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .errors import ConfigError
from .safe_read import open_regular, short

KEY = "physical_to_logical_map"
"""The table's key in a placement file (vLLM's and SGLang's attribute name)."""
MAX_BYTES = 64 << 20
"""Largest placement file read (DeepSeek-V3, 58 x 288: about 70 KB of JSON)."""
MAX_SLOTS = 1 << 24
"""Most entries of one table (layers x physical experts)."""


@dataclass(frozen=True, eq=False)
class Placement:
    """`table[l, s]`: the logical expert that physical slot `s` of MoE layer `l` holds."""

    table: np.ndarray
    """int32 `[moe layers, physical experts]`, read-only."""

    def __post_init__(self) -> None:
        t = np.array(self.table, dtype=np.int32, copy=True)
        t.flags.writeable = False
        object.__setattr__(self, "table", t)

    @property
    def layers(self) -> int:
        return int(self.table.shape[0])

    @property
    def physical(self) -> int:
        return int(self.table.shape[1])

    def digest(self) -> str:
        """blake2b-128 of the table (shape and int32 values): what a plan records."""
        h = hashlib.blake2b(digest_size=16)
        h.update(msgpack.packb([KEY, self.layers, self.physical]))
        h.update(np.ascontiguousarray(self.table, dtype="<i4").data)
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self.table.shape == other.table.shape \
            and bool(np.array_equal(self.table, other.table))

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return f"Placement({self.layers} layers x {self.physical} slots, {self.digest()[:12]})"

    def slots(self, ep: int, rank: int) -> range:
        """Physical slots of EP rank `rank` of `ep` (vLLM and SGLang: an even split)."""
        per = self.physical // ep
        return range(rank * per, (rank + 1) * per)

    def replicas(self, layer: int, num_experts: int) -> np.ndarray:
        """Physical replicas of each logical expert in MoE layer `layer`."""
        return np.bincount(self.table[layer], minlength=num_experts)

    def moved(self, other: Placement) -> np.ndarray:
        """`(layer, slot)` rows (int64 `[n, 2]`) whose logical expert differs in `other`."""
        if self.table.shape != other.table.shape:
            raise ConfigError(f"target.placement: a table of {other.layers} x {other.physical} "
                              f"after one of {self.layers} x {self.physical}; the physical "
                              "slot count changed: compile the plan from scratch")
        return np.argwhere(self.table != other.table).astype(np.int64)

    def check(self, num_experts: int, moe_layers: int, ep: int, key: str = "target.placement"
              ) -> None:
        """Refuse a table that does not fit the model and EP size, in one line."""
        t = self.table
        if t.shape[0] != moe_layers:
            raise ConfigError(f"{key}: {t.shape[0]} rows for a model of {moe_layers} MoE "
                              "layers; give one row per MoE layer, in layer order")
        if t.shape[1] < num_experts:
            raise ConfigError(f"{key}: {t.shape[1]} physical experts for {num_experts} logical "
                              "ones; give at least one slot per logical expert")
        if t.shape[1] % ep:
            raise ConfigError(f"{key}: {t.shape[1]} physical experts do not split evenly over "
                              f"{ep} EP ranks; use a multiple of {ep} (vLLM and SGLang require it)")
        bad = np.argwhere((t < 0) | (t >= num_experts))
        if len(bad):
            layer, slot = (int(x) for x in bad[0])
            raise ConfigError(f"{key}: MoE layer {layer} slot {slot} holds expert "
                              f"{int(t[layer, slot])}, outside 0..{num_experts - 1}; fix the table")
        for layer in range(t.shape[0]):
            missing = np.flatnonzero(np.bincount(t[layer], minlength=num_experts) == 0)
            if len(missing):
                raise ConfigError(f"{key}: MoE layer {layer} has no slot for expert "
                                  f"{int(missing[0])}; every logical expert needs one")


def from_plain(value: Any, key: str = "target.placement") -> Placement:
    """A placement from plain data: a map with `physical_to_logical_map`, or the table."""
    if isinstance(value, dict):
        if set(value) != {KEY}:
            raise ConfigError(f"{key}: keys {sorted(map(str, value))[:4]}; give one key, {KEY}")
        value = value[KEY]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(row, (list, tuple)) for row in value):  # a path is read by Config
        raise ConfigError(f"{key}: {short(value)} is not a table; give {KEY} as a list of "
                          "rows (one per MoE layer) of logical expert ids")
    width = len(value[0]) if isinstance(value[0], (list, tuple)) else 0
    if width == 0 or any(len(row) != width for row in value) or len(value) * width > MAX_SLOTS:
        raise ConfigError(f"{key}: rows of unequal or zero length (or over {MAX_SLOTS:,} "
                          "entries); every MoE layer has the same physical slots")
    if not all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x < 1 << 30
               for row in value for x in row):  # (ragged rows are refused above)
        raise ConfigError(f"{key}: a value that is not a small integer; the table holds "
                          "logical expert ids")
    return Placement(np.array(value, dtype=np.int64))


def load(path: str, key: str = "target.placement") -> Placement:
    """A placement file: JSON or msgpack (told by its first byte), bounded, checked."""
    fix = "give the path to a JSON or msgpack file with physical_to_logical_map"
    with open_regular(path, key, fix, ConfigError) as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{key}: {short(os.fspath(path))} is over {MAX_BYTES:,} bytes; {fix}")
    try:
        if data[:1] in (b"{", b"[", b" ", b"\n"):
            raw = json.loads(data)
        else:
            raw = msgpack.unpackb(data, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ConfigError(f"{key}: {short(os.fspath(path))} is neither JSON nor msgpack "
                          f"({type(e).__name__}); {fix}") from None
    return from_plain(raw, key)


def dump(placement: Placement, path: str) -> None:
    """Write `placement` as a JSON file `load` reads."""
    with open(path, "w") as f:
        json.dump({KEY: placement.table.tolist()}, f, separators=(",", ":"))


def encode_placement(placement: Placement, base: str) -> dict[str, Any]:
    """The header's `placement` map: digest, shape, the int32 table as bytes, and `base`,
    the fingerprint of everything else the plan depends on (the plan's fingerprint is
    `fingerprint(base, placement)`)."""
    return {"digest": placement.digest(), "base": base, "layers": placement.layers,
            "physical": placement.physical,
            "table": np.ascontiguousarray(placement.table, dtype="<i4").tobytes()}


def decode_placement(raw: Any, what: str, error: type[Exception]
                     ) -> tuple[Placement | None, str]:
    """`encode_placement`'s map back as (placement, base) ((None, ""): absent), every key
    checked; `error` names it."""
    if raw is None:
        return None, ""
    ok = isinstance(raw, dict) and set(raw) == {"digest", "base", "layers", "physical",
                                                "table"} \
        and isinstance(raw["base"], str) and len(raw["base"]) <= 64 \
        and all(isinstance(raw[k], int) and not isinstance(raw[k], bool) and 0 < raw[k]
                for k in ("layers", "physical")) \
        and raw["layers"] * raw["physical"] <= MAX_SLOTS and isinstance(raw["table"], bytes) \
        and len(raw["table"]) == 4 * raw["layers"] * raw["physical"] \
        and isinstance(raw["digest"], str)
    if not ok:
        raise error(f"{what}: placement is not a map of digest, layers, physical and an int32 "
                    "table of layers x physical; the file is corrupt: recompile it")
    table = np.frombuffer(raw["table"], dtype="<i4").reshape(raw["layers"], raw["physical"])
    placement = Placement(table)
    if placement.digest() != raw["digest"]:
        raise error(f"{what}: placement digest {short(raw['digest'])} is not its table's "
                    f"({placement.digest()}); the file is corrupt: recompile it")
    return placement, raw["base"]


def fingerprint(base: str, placement: Placement) -> str:
    """A placement plan's fingerprint: of its `base` (spec, layouts with the experts' slots
    unnamed, topology, options) and the placement's digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(msgpack.packb([base, placement.digest()]))
    return h.hexdigest()
