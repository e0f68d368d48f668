"""The plan header: what the compiler decided about the whole plan, typed.

Encoded as one msgpack map (`PlanHeader.encode`/`decode`, like `RankPlan`); rows that repeat
per rank or NIC travel as short lists and are named here (`RankRow`, `RankStats`, `NicRow`).
`decode` checks every key (type, range) and raises `PlanFormatError` naming it: a reader
never indexes raw data. Facts the compiler knows (e.g. `source_replicated`) are stored, not
re-derived by readers from config dicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from schemas.config import ClusterConfig, ConfigError, Options, SourceConfig, TargetConfig
from schemas.config_load import config_from_dict

from .errors import PlanFormatError
from .placement import Placement, decode_placement, encode_placement

Plain = None | bool | int | float | str | bytes | list["Plain"] | dict[str, "Plain"]
"""Plain msgpack data (what another module describes and owns)."""
_MAX = 1 << 62
MAX_WORLD = 1 << 16
"""Ranks in one plan (real plans: hundreds); `read_header` refuses a header over it."""
MAX_STAGES = 1 << 14
"""Stages in one plan: every rank walks every stage every step."""


@dataclass(frozen=True, slots=True)
class RankRow:
    role: str
    """`source` or `target`."""
    host: int
    gpu: int
    nic: str
    """Name of the rank's NIC (`h<host>/nic<i>`)."""


@dataclass(frozen=True, slots=True)
class RankStats:
    writes: int
    bytes_out: int
    bytes_in: int
    packs: int
    """PACK and QUANT copies."""
    unpacks: int
    staging: int
    """Staging bytes."""


@dataclass(frozen=True, slots=True)
class NicRow:
    name: str
    host: int
    gbps: float
    bytes_out: int
    """Bytes sent over this NIC (remote writes)."""
    bytes_in: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_type: str = ""
    num_layers: int = 0
    total_params: int = 0
    tensors: int = 0
    """Logical tensors."""
    longest_row_bytes: int = 0
    """An upper bound on one row (last dim) of any logical tensor, in bytes."""
    vocab: int = 0
    """Vocabulary rows of the checkpoint (`vocab_size`), before any engine's padding."""


@dataclass(frozen=True, slots=True)
class PlanStats:
    writes: int = 0
    bytes: int = 0
    packs: int = 0
    unpacks: int = 0
    quants: int = 0
    chunks: int = 0
    gather_unit_max: int = 0
    """The largest fan-out (bytes) one gather owner took as a unit."""
    staging_max: int = 0
    nvlink_bytes: int = 0
    remote_bytes: int = 0
    floor_s: float = 0.0
    """The busiest NIC or NVLink direction at full bandwidth."""
    egress_bound_max_over_mean: float = 1.0
    """The best egress balance the layouts allow."""


@dataclass(frozen=True, slots=True)
class BlobEntry:
    offset: int
    """From the start of the blobs."""
    length: int
    digest: bytes
    """blake2b-256 of the blob."""


@dataclass(frozen=True, slots=True)
class PlanHeader:
    fingerprint: str = ""
    """Hash of (spec, layouts, topology, options): peers compare it at connect."""
    world: int = 0
    """Plan ranks (0: unknown, a hand-built plan)."""
    sources: int = 0
    targets: int = 0
    replicas: int = 1
    stages: int = 0
    """Stages every rank walks (0: unknown)."""
    created_by: str = ""
    model: ModelInfo = field(default_factory=ModelInfo)
    source: SourceConfig | None = None
    target: TargetConfig | None = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    options: Options = field(default_factory=Options)
    nvlink_gbps: float = 3600.0
    ranks: tuple[RankRow, ...] = ()
    rank_stats: tuple[RankStats, ...] = ()
    nics: tuple[NicRow, ...] = ()
    stats: PlanStats = field(default_factory=PlanStats)
    source_replicated: bool = False
    """Every source rank holds the whole model (pure data parallelism): `verify` checks the
    NIC balance bound of `assign` only then."""
    identities: tuple[dict[str, int | str], ...] = ()
    """Per plan rank, its coordinates in its framework's terms (`schemas/identity.py`);
    empty when the plan records none."""
    derived: tuple[tuple[dict[str, Plain], ...], ...] = ()
    """Per plan rank, the derived tensors it refreshes after a step (owned by the module that
    compiles them); empty when none."""
    placement: Placement | None = None
    """The expert placement (EPLB) the target layout was built from, recorded whole with its
    digest (`schemas/placement.py`); None when the engine's default placement was assumed.
    A backend compares it with the engine's at each update."""
    placement_base: str = ""
    """With a placement: the fingerprint of everything but it (`placement.fingerprint`), so a
    replan for a new placement (`planner/replan.py`) gives the fingerprint a full compile does."""
    blobs: Mapping[str, BlobEntry] = field(default_factory=lambda: MappingProxyType({}))
    """Where every blob is (`rank/<r>`, `explain`, `dag`); set by the codec."""
    signature: bytes = b""
    """HMAC-SHA256 of the unsigned header (`schemas/integrity.py`), or empty."""

    def encode(self) -> dict[str, Any]:
        """The msgpack map, without `blobs` and `signature` (the codec adds them)."""
        cfg = {k: None if v is None else dataclasses.asdict(v) for k, v in
               (("source", self.source), ("target", self.target), ("cluster", self.cluster),
                ("options", self.options))}
        if cfg["target"] is not None:  # no key unless set: such plans keep their bytes
            cfg["target"].pop("placement")  # recorded whole below, under its own key
            sh = cfg["target"].pop("shadow")
            if sh is not None:
                cfg["target"]["shadow"] = "full" if not sh["budget_bytes"] else sh
        extra = {} if self.placement is None else {"placement": encode_placement(
            self.placement, self.placement_base)}
        return {
            **extra, "fingerprint": self.fingerprint, "world": self.world, "sources": self.sources,
            "targets": self.targets, "replicas": self.replicas, "stages": self.stages,
            "created_by": self.created_by, "model": dataclasses.asdict(self.model), **cfg,
            "nvlink_gbps": self.nvlink_gbps,
            "ranks": [[r.role, r.host, r.gpu, r.nic] for r in self.ranks],
            "rank_stats": [list(dataclasses.astuple(s)) for s in self.rank_stats],
            "nics": [dataclasses.asdict(n) for n in self.nics],
            "stats": dataclasses.asdict(self.stats), "source_replicated": self.source_replicated,
            "identities": [dict(i) for i in self.identities],
            "derived": [list(d) for d in self.derived],
        }

    @staticmethod
    def decode(raw: Any, what: str = "plan header") -> PlanHeader:
        if not isinstance(raw, dict):
            raise PlanFormatError(f"{what}: is not a map; the file is corrupt")
        r = _Reader(raw, what)
        h = PlanHeader(
            fingerprint=r.str("fingerprint"), world=r.int("world"), sources=r.int("sources"),
            targets=r.int("targets"), replicas=r.int("replicas", 1), stages=r.int("stages"),
            created_by=r.str("created_by"), model=r.row("model", ModelInfo, as_map=True),
            **_configs(raw, what), nvlink_gbps=r.num("nvlink_gbps", 3600.0),
            ranks=r.rows("ranks", RankRow), rank_stats=r.rows("rank_stats", RankStats),
            nics=r.rows("nics", NicRow, as_map=True),
            stats=r.row("stats", PlanStats, as_map=True),
            source_replicated=r.bool("source_replicated"),
            identities=_identities(raw.get("identities", []), what),
            derived=_derived(raw.get("derived", []), what),
            **dict(zip(("placement", "placement_base"), decode_placement(
                raw.get("placement"), what, PlanFormatError))),
            blobs=_blobs(raw.get("blobs", {}), what), signature=r.bytes("signature"))
        if len(h.fingerprint) > 64:
            raise PlanFormatError(f"{what}: fingerprint of {len(h.fingerprint)} characters (the "
                                  "compiler writes 32); the file is corrupt: recompile it")
        for name in ("ranks", "rank_stats", "identities", "derived"):
            n = len(getattr(h, name))
            if n and n != h.world:
                raise PlanFormatError(f"{what}: {name} has {n} rows for a world of {h.world} "
                                      "ranks; the file is corrupt")
        return h


class _Reader:
    """Typed reads of one map's keys; each failure names the key."""

    def __init__(self, raw: dict[str, Any], what: str) -> None:
        self.raw, self.what = raw, what

    def fail(self, key: str, value: Any, want: str) -> PlanFormatError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return PlanFormatError(f"{self.what}: {key} = {shown} is not {want}; the file is "
                               "corrupt or was written by another version: recompile it")

    def check(self, key: str, v: Any, kind: str) -> Any:
        """`v` as a value of `kind` (int, float, str, bool, bytes), or the error."""
        if kind == "int" and not isinstance(v, bool) and isinstance(v, int) \
                and -_MAX <= v <= _MAX:
            return v
        if kind == "float" and not isinstance(v, bool) and isinstance(v, (int, float)) \
                and math.isfinite(v):
            return float(v)
        if kind == "str" and isinstance(v, str) and len(v) <= 4096:
            return v
        if kind == "bool" and isinstance(v, bool):
            return v
        if kind == "bytes" and isinstance(v, bytes) and len(v) <= 1024:
            return v
        raise self.fail(key, v, {"int": "an integer in range", "float": "a finite number",
                                 "str": "a string", "bool": "true or false",
                                 "bytes": "bytes"}.get(kind, kind))

    def int(self, key: str, default: int = 0) -> int:
        return self.check(key, self.raw.get(key, default), "int")

    def num(self, key: str, default: float = 0.0) -> float:
        return self.check(key, self.raw.get(key, default), "float")

    def str(self, key: str, default: str = "") -> str:
        return self.check(key, self.raw.get(key, default), "str")

    def bool(self, key: str, default: bool = False) -> bool:
        return self.check(key, self.raw.get(key, default), "bool")

    def bytes(self, key: str) -> bytes:
        return self.check(key, self.raw.get(key, b""), "bytes")

    def _build(self, key: str, cls: type, values: Any, as_map: bool) -> Any:
        fields = dataclasses.fields(cls)
        if as_map:
            if not isinstance(values, dict):
                raise self.fail(key, values, "a map")
            values = [values.get(f.name, f.default) for f in fields]
        if not isinstance(values, list) or len(values) != len(fields):
            raise self.fail(key, values, f"a list of {len(fields)} values")
        return cls(**{f.name: self.check(f"{key}.{f.name}", v, str(f.type))
                      for f, v in zip(fields, values)})

    def row(self, key: str, cls: type, as_map: bool = False) -> Any:
        return self._build(key, cls, self.raw.get(key, {} if as_map else []), as_map)

    def rows(self, key: str, cls: type, as_map: bool = False) -> tuple[Any, ...]:
        v = self.raw.get(key, [])
        if not isinstance(v, list):
            raise self.fail(key, v, "a list")
        return tuple(self._build(f"{key}[{i}]", cls, x, as_map) for i, x in enumerate(v))


def _configs(raw: dict[str, Any], what: str) -> dict[str, Any]:
    """source, target, cluster and options, checked by their own config classes."""
    data = {"model": {"config": "plan"}, "source": {"framework": "fsdp2"},
            "target": {"engine": "vllm"}}
    for key in ("source", "target", "cluster", "options"):
        if raw.get(key) is not None:
            data[key] = raw[key]
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        raise PlanFormatError(f"{what}: {e}") from None
    return {"source": cfg.source if raw.get("source") is not None else None,
            "target": cfg.target if raw.get("target") is not None else None,
            "cluster": cfg.cluster, "options": cfg.options}


def _identities(raw: Any, what: str) -> tuple[dict[str, int | str], ...]:
    ok = isinstance(raw, list) and all(
        isinstance(d, dict) and len(d) <= 64 and all(
            isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool)
            for k, v in d.items()) for d in raw)
    if not ok:
        raise PlanFormatError(f"{what}: identities is not a list of flat maps (name -> int or "
                              "str); the file is corrupt")
    return tuple(dict(d) for d in raw)


def _derived(raw: Any, what: str) -> tuple[tuple[dict[str, Plain], ...], ...]:
    ok = isinstance(raw, list) and all(
        isinstance(lst, list) and all(isinstance(e, dict) for e in lst) for lst in raw)
    if not ok:
        raise PlanFormatError(f"{what}: derived is not a list of lists of maps (one list per "
                              "rank); the file is corrupt")
    return tuple(tuple(lst) for lst in raw)


def _blobs(raw: Any, what: str) -> Mapping[str, BlobEntry]:
    if not isinstance(raw, dict):
        raise PlanFormatError(f"{what}: blobs is not a map; the file is corrupt")
    out = {}
    for name, entry in raw.items():
        if not (isinstance(entry, list) and len(entry) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1 << 48
                        for x in entry[:2]) and isinstance(entry[2], bytes)):
            raise PlanFormatError(f"{what}: blob {name!r} has a bad index entry "
                                  f"({str(entry)[:60]}); the file is corrupt")
        out[name] = BlobEntry(entry[0], entry[1], entry[2])
    return MappingProxyType(out)
