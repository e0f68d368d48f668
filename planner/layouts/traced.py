"""vLLM target layouts traced from the engine's own loader, cached on disk.

`target.layout: traced` (and `auto`, the default, for a model type without hand-written
vLLM rules) builds vLLM 0.33's model for each rank of one engine on the meta device and
records its `load_weights` (`planner/layouts/vllm_trace.py`, which imports torch and vLLM).
Replicas reuse the engine's trace. A trace is cached under `~/.cache/rdma-plan/traced/`
(or `$RDMA_PLAN_CACHE`), keyed by the model config (with overrides), the vLLM version and
the engine's parallel config; a cache hit needs neither torch nor vLLM. A cache file is
read like any other input: size-limited, type-checked, every piece inside its logical tensor
and its parameter; one that fails is traced again and replaced.

Cache file (msgpack map): `format` (1), `key`, `ranks`: per engine rank, a list of
`[name, shape, dtype, pieces]`, each piece `[tensor, offsets, sizes, at, dims | None]`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack

from planner.collector import gc_paused
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.layouts.trace_geometry import encode_rank
from planner.spec import SUPPORTED_MODEL_TYPES, ModelSpec
from schemas.config import Config, ConfigError, TargetConfig

FORMAT = 1
HAND_WRITTEN = SUPPORTED_MODEL_TYPES  # the families planner/layouts/vllm.py has rules for
"""Model types `planner/layouts/vllm.py` has rules for (`auto` uses them)."""
MAX_CACHE_BYTES = 1 << 30


def uses_trace(spec: ModelSpec, cfg: TargetConfig) -> bool:
    """Whether the target layout of `cfg` comes from a trace of vLLM's loader."""
    if cfg.engine != "vllm" or cfg.layout == "rules":
        return False
    return cfg.layout == "traced" or spec.dims.model_type not in HAND_WRITTEN


def check(spec: ModelSpec, cfg: TargetConfig) -> None:
    """The rules of a traced target are vLLM's own: building the engine's model for the
    trace runs them and a refusal is one line naming `target` (`vllm_trace.engine_config`);
    a cached trace was built under the same parallel config. What is checked here is only
    what the trace cannot express."""
    if cfg.placement is not None:
        raise ConfigError("target.placement: an expert placement is laid out by the hand-"
                          f"written rules only, not by a trace (target.layout {cfg.layout!r}, "
                          f"model_type {spec.dims.model_type!r}); use target.layout: rules")
    if cfg.w13_order != "w1w3" or cfg.expert_names != "routed_experts":
        key, value = (("target.w13_order", cfg.w13_order) if cfg.w13_order != "w1w3"
                      else ("target.expert_names", cfg.expert_names))
        raise ConfigError(f"{key}: {value!r} is not what vLLM 0.33's loader writes; remove it "
                          "with target.layout: traced, or use target.layout: rules")


def model_hf(cfg: Config) -> dict[str, Any]:
    """The HF config the spec was built from: config.json with `model.overrides` and
    `model.num_layers` applied (as `planner.spec.spec_from_hf` applies them)."""
    from planner.spec import read_hf_config

    hf = read_hf_config(cfg.model_config_path)
    hf.update(dict(cfg.model.overrides))
    if cfg.model.num_layers is not None:
        hf["num_hidden_layers"] = cfg.model.num_layers
    return hf


def cache_dir() -> str:
    return os.environ.get("RDMA_PLAN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rdma-plan")


def engine_version() -> str:
    try:
        return "vllm " + importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vllm (not installed)"


def cache_key(hf: dict[str, Any], cfg: TargetConfig) -> str:
    """Digest of (model config, engine version, one engine's parallel config and dtype)."""
    parallel = {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "ep": cfg.ep, "dtype": cfg.dtype}
    text = json.dumps({"format": FORMAT, "hf": hf, "engine": engine_version(),
                       "parallel": parallel}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def layout(spec: ModelSpec, cfg: TargetConfig, hf: dict[str, Any],
           folder: str | None = None) -> Layout:
    """The traced vLLM layout of `cfg.replicas` engines (one trace, reused by replicas)."""
    check(spec, cfg)
    return replicated(engine_ranks(spec, cfg, hf, folder or cache_dir()), cfg)


def replicated(engine: Sequence[tuple[PhysicalTensor, ...]], cfg: TargetConfig) -> Layout:
    """The layout of `cfg.replicas` engines, each `engine`'s ranks (the same tuples)."""
    ranks = tuple(RankLayout(rank=r * len(engine) + i, replica=r, tensors=tensors)
                  for r in range(cfg.replicas) for i, tensors in enumerate(engine))
    return Layout(side="target", framework="vllm", ranks=ranks, replicas=cfg.replicas)


def cache_path(folder: str, key: str) -> str:
    return os.path.join(folder, "traced", key + ".msgpack")


def engine_ranks(spec: ModelSpec, cfg: TargetConfig, hf: dict[str, Any],
                 folder: str) -> list[tuple[PhysicalTensor, ...]]:
    """One engine's ranks, from the cache or traced (and then cached)."""
    key = cache_key(hf, cfg)
    path = cache_path(folder, key)
    cached = read_cache(path, key, spec, cfg.engine_world)
    if cached is not None:
        return cached
    engine = [tuple(r) for r in _trace(spec, hf, replace(cfg, replicas=1))]
    cache_quietly(path, key, [msgpack.packb(encode_rank(rank)) for rank in engine])
    return engine


def cache_quietly(path: str, key: str, ranks: list[bytes]) -> None:
    """`write_packed`; a read-only or full disk costs the next compile a trace, no more."""
    try:
        write_packed(path, key, ranks)
    except OSError as e:
        print(f"rdma-plan: traced layout not cached ({e}); set RDMA_PLAN_CACHE to a writable "
              "folder", file=sys.stderr)


def _trace(spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig) -> list[list[PhysicalTensor]]:
    """One engine traced in this process (`_trace_rows`), decoded and checked."""
    with gc_paused():
        return [list(decode_rank(rank, spec)) for rank in _trace_rows(spec, hf, cfg)]


def _trace_rows(spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig) -> list[list[Any]]:
    """One engine's `encode_rank` rows, unchecked (`trace_packed`, unpacked)."""
    with gc_paused():
        return [msgpack.unpackb(rank, strict_map_key=True)
                for rank in trace_packed(spec, hf, cfg)]


def trace_packed(spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig) -> list[bytes]:
    """Import torch and vLLM and trace one engine (each rank's `encode_rank` rows as msgpack
    bytes, unchecked), with the cyclic garbage collector paused: importing vLLM allocates
    millions of objects, and collecting them over and over while they are all still alive
    is a large share of the import (and of building the models)."""
    with gc_paused():
        try:
            from planner.layouts import vllm_trace
        except ImportError as e:
            raise ConfigError(f"target.layout: traced needs torch and vLLM 0.33 to trace (and "
                              f"no cached trace was found): {e}; install them "
                              "(tests/oracles/install_vllm.sh) or use target.layout: rules"
                              ) from None
        vllm_trace.check_known(hf)
        return vllm_trace.trace_engine(spec, hf, cfg)


# ---------------------------------------------------------------- the cache file


def decode_rank(rows: Any, spec: ModelSpec) -> tuple[PhysicalTensor, ...]:
    """`encode_rank`'s rows, checked: types, names in `spec`, every piece in bounds
    (raises ValueError, TypeError, KeyError or IndexError otherwise)."""
    if not isinstance(rows, list):
        raise ValueError("a rank is not a list")
    return tuple(_tensor(t, spec) for t in rows)


def write_cache(path: str, key: str, engine: Sequence[Sequence[PhysicalTensor]]) -> None:
    """Write one engine's ranks (`write_rows`)."""
    write_rows(path, key, [encode_rank(rank) for rank in engine])


def write_rows(path: str, key: str, ranks: list[Any]) -> None:
    """Write one engine's ranks as `encode_rank`'s rows (`write_packed`)."""
    write_packed(path, key, [msgpack.packb(rank) for rank in ranks])


def write_packed(path: str, key: str, ranks: list[bytes]) -> None:
    """Write one engine's ranks, each `encode_rank`'s rows as msgpack bytes, atomically (a
    temporary file renamed), so a reader never sees half a file. The file is the bytes of
    `msgpack.packb({"format": FORMAT, "key": key, "ranks": rows})`: a map's and an array's
    msgpack are their header and their items' msgpack, one after another."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    packer = msgpack.Packer()
    head = b"".join((packer.pack_map_header(3), packer.pack("format"), packer.pack(FORMAT),
                     packer.pack("key"), packer.pack(key), packer.pack("ranks"),
                     packer.pack_array_header(len(ranks))))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        for rank in ranks:
            f.write(rank)
    os.replace(tmp, path)


def read_cache(path: str, key: str, spec: ModelSpec,
               world: int) -> list[tuple[PhysicalTensor, ...]] | None:
    """The cached engine, or None when absent or not a valid trace for `spec`."""
    try:
        if os.path.getsize(path) > MAX_CACHE_BYTES:
            return None
        with open(path, "rb") as f, gc_paused():
            raw = msgpack.unpackb(f.read(), strict_map_key=True, use_list=True)
            return _decode(raw, key, spec, world)
    except (OSError, ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData,
            msgpack.FormatError, msgpack.StackError):
        return None


def _ints(x: Any, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(x, list) or (n is not None and len(x) != n) or not all(
            type(v) is int and v >= 0 for v in x):
        raise ValueError("not a list of non-negative ints")
    return tuple(x)


def _decode(raw: Any, key: str, spec: ModelSpec,
            world: int) -> list[tuple[PhysicalTensor, ...]] | None:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("key") != key:
        return None
    ranks = raw["ranks"]
    if not isinstance(ranks, list) or len(ranks) != world:
        return None
    return [decode_rank(rank, spec) for rank in ranks]


def _tensor(t: Any, spec: ModelSpec) -> PhysicalTensor:
    name, shape, dtype, pieces = t
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(pieces, list):
        raise ValueError("bad tensor row")
    shape = _ints(shape)
    return PhysicalTensor(name, shape, dtype, tuple(_piece(p, spec, shape) for p in pieces))


def _piece(p: Any, spec: ModelSpec, shape: tuple[int, ...]) -> Piece:
    tensor, offsets, sizes, at, dims = p
    logical = spec.by_name[tensor]
    n = len(logical.shape)
    offsets, sizes, at = _ints(offsets, n), _ints(sizes, n), _ints(at, len(shape))
    piece = Piece(tensor, offsets, sizes, at, None if dims is None else _ints(dims, n))
    if any(o + s > d for o, s, d in zip(offsets, sizes, logical.shape)) or any(
            a + s > d for a, s, d in zip(at, piece.phys_sizes(), shape)):
        raise ValueError("piece out of bounds")
    return piece
