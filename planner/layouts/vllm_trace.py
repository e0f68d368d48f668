"""Trace vLLM 0.33's own `load_weights` into pieces (imports torch and vLLM; only
`planner/layouts/traced.py` imports this module, and only on a cache miss).

For one engine rank: vLLM's distributed state is faked (TP/PP/DP/EP groups of the right
sizes and ranks, no process group), the model is built on the meta device, and its
`load_weights` runs over meta stand-ins of the checkpoint tensors under a
`TorchFunctionMode` that records every `copy_` from a stand-in's storage into a parameter's
storage. Meta tensors keep sizes, strides and storage offsets, so a copy's two views give
the logical box and where it lands in the parameter. Anything else computed from
checkpoint data (a product, a `cat`, a cast into a new tensor) is marked tainted; copying
a tainted tensor into a parameter is refused naming the parameter and the operation.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from planner.errors import TraceError  # noqa: E402
from planner.layouts import trace_layers  # noqa: E402
from planner.layouts.base import PhysicalTensor, Piece  # noqa: E402
from planner.layouts.trace_geometry import View, encode_rank, piece  # noqa: E402
from planner.layouts.vllm_groups import fake_parallel_state  # noqa: E402
from planner.spec import SUPPORTED_MODEL_TYPES, ModelSpec  # noqa: E402
from schemas.config import ConfigError, TargetConfig  # noqa: E402

COPIES = {torch.Tensor.copy_}
"""Operations that move checkpoint data into a parameter (recorded)."""


def check_known(hf: dict[str, Any]) -> None:
    """One clear line when vLLM cannot build the model: neither transformers nor vLLM knows
    its `model_type`/`architectures`, or vLLM does not serve it."""
    import transformers
    import vllm
    from transformers import CONFIG_MAPPING
    from vllm.model_executor.models import ModelRegistry

    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    served = sorted(a for a in ModelRegistry.get_supported_archs() if a.endswith("ForCausalLM"))
    if isinstance(archs, list) and any(a in served for a in archs):
        return
    known = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    who = (f"vLLM {vllm.__version__} serves none of its architectures {archs}" if known else
           f"neither transformers {transformers.__version__} nor vLLM {vllm.__version__} "
           "knows it")
    raise TraceError(f"model.config: model_type {model_type!r}: {who}; supported: the "
                     f"hand-written families ({', '.join(SUPPORTED_MODEL_TYPES)}) and, traced, any "
                     f"of vLLM's {len(served)} causal LMs: {', '.join(served)}")


def _check_platform() -> None:
    """vLLM settles its platform once, on first use, and many of its modules keep that
    object: if it was settled before this module set VLLM_TARGET_DEVICE=cpu (an earlier
    import touched it on a box with no GPU), it has no device and vLLM's engine check fails
    with a line that blames the target. Say what happened instead."""
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        raise TraceError("target: vLLM settled on a platform with no device before rdma-plan "
                         "could set VLLM_TARGET_DEVICE=cpu; set VLLM_TARGET_DEVICE=cpu (or "
                         "import planner.layouts.vllm_trace) before vLLM is first imported")


def _in_process(fn: Any) -> Any:
    return fn()


@contextlib.contextmanager
def _inspected_here(registry: Any) -> Iterator[None]:
    """vLLM's model inspection (`registry._run_in_subprocess`) run in this process while
    the block runs; where a vLLM has no such function, nothing changes (its own way runs)."""
    was = getattr(registry, "_run_in_subprocess", None)
    if was is None:
        yield
        return
    registry._run_in_subprocess = _in_process
    try:
        yield
    finally:
        registry._run_in_subprocess = was


def engine_config(hf: dict[str, Any], cfg: TargetConfig) -> Any:
    """vLLM's `VllmConfig` for one engine of `cfg` (vLLM's own checks run here).

    vLLM inspects a model class it has not cached (`~/.cache/vllm/modelinfos`) in a new
    Python process, so that importing the model cannot initialize CUDA in the engine's own
    process: a second import of vLLM, seconds per model family on a fresh machine. A trace
    imports the model's module here anyway (`trace_engine`) and builds it on the meta
    device, so the inspection runs here too (vLLM still writes its cache; a vLLM without
    that step inspects its own way)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import registry

    _check_platform()
    with tempfile.TemporaryDirectory(prefix="rdma-plan-trace-") as folder, \
            _inspected_here(registry):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(hf, f)
        try:
            return EngineArgs(model=folder, skip_tokenizer_init=True, dtype=cfg.dtype,
                              load_format="dummy", tensor_parallel_size=cfg.tp,
                              pipeline_parallel_size=cfg.pp, data_parallel_size=cfg.dp,
                              enable_expert_parallel=cfg.ep, enforce_eager=True,
                              max_model_len=128).create_engine_config()
        except Exception as e:  # noqa: BLE001 - vLLM's own config check (pydantic, ValueError)
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [repr(e)]
            why = next((ln for ln in lines if ln.startswith("Value error,")), lines[0])
            why = why.removeprefix("Value error,").split(" [type=")[0].strip()
            raise TraceError(f"target: vLLM refuses this engine ({why[:300]}); fix target "
                             "tp/pp/dp/ep or the model config") from None


# ---------------------------------------------------------------- the recorder


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    shape: tuple[int, ...]


class Recorder(TorchFunctionMode):
    """Records `copy_` from checkpoint stand-ins into parameters; taints arithmetic."""

    def __init__(self, params: dict[int, str], sources: dict[int, _Source]) -> None:
        super().__init__()
        self.params, self.sources = params, sources
        self.tainted: dict[int, str] = {}
        """storage -> what computed it (from checkpoint data)."""
        self.pieces: dict[str, list[Piece]] = {n: [] for n in params.values()}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in COPIES:
            self._copy(args[0], args[1])
        elif func is torch.Tensor.__setitem__ and _key(args[2]) in self._watched():
            self._copy(args[0][args[1]], args[2])  # the mode is off inside its handler
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not out.is_meta:
            return out  # the hot path: vLLM's CPU bookkeeping (expert maps), never data
        self._taint(func, args, kwargs, out)
        return out

    def _watched(self) -> set[int]:
        return self.sources.keys() | self.tainted.keys()

    def _taint(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A new tensor computed from checkpoint data is tainted (views share storage).
        Fast path first: most calls return no tensor (`dim`, `item`, `size`)."""
        if isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = [o for o in out if isinstance(o, torch.Tensor)]
            if not outs:
                return
        else:
            return
        why = src = None  # the first tainted input's reason, the first stand-in's name
        for a in _tensors((args, kwargs)):
            if a.is_meta:  # stand-ins are meta
                k = _key(a)
                if why is None:
                    why = self.tainted.get(k)
                if src is None and k in self.sources:
                    src = self.sources[k].name
        if why is None and src is None:
            return
        for o in outs:
            k = _key(o)
            if k not in self.sources and k not in self.params and k not in self.tainted:
                self.tainted[k] = why or f"{getattr(func, '__name__', func)} on {src}"

    def _copy(self, dst: torch.Tensor, src: Any) -> None:
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return
        ks, kd = _key(src), _key(dst)
        if kd not in self.params:
            return
        param = self.params[kd]
        if ks in self.tainted:
            raise TraceError(f"target.layout: traced: vLLM's loader writes {param} from "
                             f"arithmetic ({self.tainted[ks]}); a traced layout takes only "
                             "views, slices, narrows and copies: use target.layout: rules "
                             "where a hand-written layout exists")
        if ks not in self.sources:
            return  # a constant (zeros, a fill): padding, not logical data
        source = self.sources[ks]
        self.pieces[param].append(piece(source.name, source.shape, _view(src), _view(dst),
                                        self.shapes[param], param))


def _view(t: torch.Tensor) -> View:
    return View(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _key(t: Any) -> int:
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else -1


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts (a function's args and kwargs)."""
    out, todo = [], [x]
    while todo:
        y = todo.pop()
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (list, tuple)):
            todo.extend(y)
        elif isinstance(y, dict):
            todo.extend(y.values())
    return out


# ---------------------------------------------------------------- one rank


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The checkpoint's tensors and what every rank's trace asks of them, computed once
    per engine; its meta stand-ins are made per rank, for the layers the rank traces."""

    entries: list[tuple[str, tuple[int, ...], torch.dtype]]
    layers: list[int | None]
    """The decoder layer of each entry (`trace_layers.layer_of`)."""
    signatures: trace_layers.Signatures

    def stand_ins(self, layers: set[int] | None = None
                  ) -> tuple[list[tuple[str, torch.Tensor]], dict[int, _Source]]:
        """Meta tensors of the entries outside decoder layers or in `layers` (all when
        None), and each one's source by storage."""
        stream, sources = [], {}
        for (name, shape, dtype), layer in zip(self.entries, self.layers, strict=True):
            if layers is None or layer is None or layer in layers:
                tensor = torch.empty(shape, dtype=dtype, device="meta")
                stream.append((name, tensor))
                sources[_key(tensor)] = _Source(name, shape)
        return stream, sources


def _checkpoint(spec: ModelSpec, dtype: str) -> Checkpoint:
    """The checkpoint's tensors (MTP layers left out: vLLM does not load them)."""
    entries = [(t.name, t.shape, getattr(torch, "float32" if t.buffer else dtype))
               for t in spec.tensors if not t.mtp]
    return Checkpoint(entries, [trace_layers.layer_of(n) for n, _, _ in entries],
                      trace_layers.signatures((n, shape, str(d)) for n, shape, d in entries))


def trace_rank(checkpoint: Checkpoint, vcfg: Any, cfg: TargetConfig,
               rank: tuple[int, int, int], keep: list[Any]) -> list[PhysicalTensor]:
    """One engine rank's (DP d, PP p, TP t) `named_parameters()` as pieces, from vLLM's
    `load_weights` of the `checkpoint`'s stand-ins: the representatives of each class of
    alike layers, extrapolated to the rest (`trace_layers`), or every layer when a
    representative disagrees. The models go into `keep`: vLLM caches per-model state by
    `id(model)` (`models/utils.py`), so no model may be freed while the engine's others
    are traced."""
    model, named = _build(vcfg, cfg, rank, keep)
    classes = trace_layers.classes(checkpoint.signatures,
                                   [(n, tuple(x.shape), str(x.dtype)) for n, x in named])
    some = checkpoint.stand_ins(trace_layers.representatives(classes))
    pieces = trace_layers.extrapolate(classes, [n for n, _ in named],
                                      _load(model, named, *some, vcfg, cfg, rank))
    if pieces is None:  # a loader that treats a layer by its index: trace them all
        model, named = _build(vcfg, cfg, rank, keep)
        pieces = _load(model, named, *checkpoint.stand_ins(), vcfg, cfg, rank)
    return [PhysicalTensor(n, tuple(x.shape), _dtype_name(x.dtype),
                           tuple(sorted(pieces[n], key=lambda q: q.at)))
            for n, x in named]


def _build(vcfg: Any, cfg: TargetConfig, rank: tuple[int, int, int],
           keep: list[Any]) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """vLLM's model of one rank on the meta device, and its parameters."""
    from unittest import mock

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    # `record_metadata_for_reloading` keeps a meta copy of every layer for vLLM's
    # layerwise reload (torchao models only), a large share of a rank's trace: a trace
    # never reloads
    with fake_parallel_state(cfg, *rank), set_current_vllm_config(vcfg), \
            set_default_torch_dtype(vcfg.model_config.dtype), \
            mock.patch.object(utils, "record_metadata_for_reloading", _nothing):
        vcfg.compilation_config.static_forward_context.clear()  # one model at a time
        with torch.device("meta"):
            model = utils.initialize_model(vllm_config=vcfg)
    keep.append(model)
    named = list(model.named_parameters())
    for n, x in named:
        if not x.is_contiguous():
            raise TraceError(f"target.layout: traced: parameter {n} is not contiguous")
    return model, named


def _nothing(*args: Any) -> None:
    return None


def _load(model: Any, named: list[tuple[str, torch.Tensor]],
          stream: list[tuple[str, torch.Tensor]], sources: dict[int, _Source],
          vcfg: Any, cfg: TargetConfig, rank: tuple[int, int, int]) -> dict[str, list[Piece]]:
    """The pieces that `model.load_weights(stream)` copies into each parameter."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    rec = Recorder({_key(x): n for n, x in named}, sources)
    rec.shapes = {n: tuple(x.shape) for n, x in named}
    with fake_parallel_state(cfg, *rank), set_current_vllm_config(vcfg), \
            set_default_torch_dtype(vcfg.model_config.dtype), torch.no_grad(), rec:
        model.load_weights(iter(stream))
    return rec.pieces


def trace_engine(spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig,
                 workers: int | None = None) -> list[bytes]:
    """Every rank of one engine, in engine rank order `(d * pp + p) * tp + t`, as
    msgpack bytes of its `traced.encode_rank` rows (unchecked: the caller decodes them,
    `traced.decode_rank`; packed once, by the process that traced the rank, and passed on
    as they are), traced by up to `workers` forked processes (default: one per CPU core)."""

    vcfg, checkpoint = engine_config(hf, cfg), _checkpoint(spec, cfg.dtype)
    ranks = [(d, p, t) for d in range(cfg.dp) for p in range(cfg.pp) for t in range(cfg.tp)]
    workers = min(len(ranks), workers or os.cpu_count() or 1)
    from vllm.model_executor.model_loader.utils import get_model_architecture

    get_model_architecture(vcfg.model_config)  # its modules imported once, before forking
    # torch's meta kernels and its type promotion import these on their first call: once
    # here, not in every worker (the lean import gives the few names a trace asks of them)
    import sympy  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        keep: list[Any] = []
        return [_packed(trace_rank(checkpoint, vcfg, cfg, r, keep)) for r in ranks]
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for w in range(workers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(send, checkpoint, vcfg, cfg, ranks[w::workers]),
                           daemon=True)
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    try:
        parts = [_receive(recv, len(ranks[w::workers])) for w, recv in enumerate(pipes)]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return [parts[i % workers][i // workers] for i in range(len(ranks))]


def _packed(tensors: list[PhysicalTensor]) -> bytes:
    """One rank as msgpack bytes of its `traced.encode_rank` rows."""
    import msgpack

    return msgpack.packb(encode_rank(tensors))


def _worker(send: Any, checkpoint: Checkpoint, vcfg: Any, cfg: TargetConfig,
            ranks: list[tuple[int, int, int]]) -> None:
    """A forked tracer: sends its ranks (`_packed`), or `{"error": line}`."""
    import msgpack

    keep: list[Any] = []
    try:
        out: Any = {"ranks": [_packed(trace_rank(checkpoint, vcfg, cfg, r, keep))
                              for r in ranks]}
    except ConfigError as e:
        out = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (a vLLM failure: the parent names it)
        out = {"error": f"target.layout: traced: vLLM failed while tracing "
                        f"({type(e).__name__}: {str(e)[:300]})"}
    send.send_bytes(msgpack.packb(out))
    send.close()


def _receive(recv: Any, n: int) -> list[bytes]:
    """One worker's `n` ranks (`_packed`; decoded and checked by the caller)."""
    import msgpack

    try:
        raw = msgpack.unpackb(recv.recv_bytes(), strict_map_key=True)
    except EOFError:
        raise TraceError("target.layout: traced: a tracing process died without an answer "
                         "(out of memory?); retry, or trace with fewer processes") from None
    except ValueError as e:
        raise TraceError(f"target.layout: traced: a tracing process sent a bad answer ({e})"
                         ) from None
    if isinstance(raw, dict) and "error" in raw:
        raise TraceError(str(raw["error"])[:4000])
    if not isinstance(raw, dict) or not isinstance(raw.get("ranks"), list) or len(
            raw["ranks"]) != n or not all(isinstance(r, bytes) for r in raw["ranks"]):
        raise TraceError("target.layout: traced: a tracing process sent a bad answer")
    return raw["ranks"]
