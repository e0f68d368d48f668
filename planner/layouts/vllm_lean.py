"""A lean import of vLLM for the forked tracer (`planner/layouts/trace_ahead.py`) only.

Importing what a trace needs of vLLM 0.33 costs seconds, most of it in modules a
trace never runs: Inductor and Dynamo (pulled in by `vllm.env_override`, by
`torch._inductor.custom_graph_pass`'s package, by `vllm.compilation.decorators` and by
module-level `@torch.compile`), torch's symbolic shapes and sympy (which torch's meta
kernels import on their first call), the OpenAI server's types, structured output, the
multimodal media decoders, KV-transfer connectors, `transformers`' auto-model factory,
rdma-plan's own vLLM plugin.
`install` puts a meta-path finder in front of the import system of the calling process
that

- skips the `__init__` of the packages in `SKIP_INIT` (their submodules import as usual),
- gives a placeholder module for each module in `STUBS` (its real submodules still
  import; the few names in `FAKES` work) and for every module under a prefix in
  `STUB_TREES`,
- changes a module in `PATCHES` once it has run (a faster function answering as its own,
  or a fixed answer where only a log line reads it),

and makes `torch.compile` hand back the function it is given (a trace runs no forward;
vLLM decorates functions with it at import). A placeholder module has every public name,
as a placeholder class that refuses any use a trace could depend on: calling it,
`isinstance`/`issubclass` against it, truth, iteration, membership, attributes. So a
trace either never touches what was left out, or fails (`LeanMiss`) and is traced again
with the normal import (`trace_ahead`): a lean import can cost time, never a different
layout (tests/oracles/test_vllm_trace_lean.py traces every family both ways).

Opt-in (`RDMA_PLAN_TRACE_LEAN=1`), and only for the versions it was written against
(`VERSIONS`): with any other, `install` does nothing and logs a warning naming them. Never
call it in a process that goes on to use vLLM or torch for anything else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import logging
import sys
from types import ModuleType
from typing import Any

from planner.errors import LeanMiss
from planner.layouts.vllm_lean_fakes import FAKES, compile_hints_off

log = logging.getLogger("planner")

VERSIONS = {"vllm": "0.33.", "torch": "2.13.", "transformers": "5.20."}
"""Distribution -> version prefix the lists below were measured against."""

SKIP_INIT = {
    "torch._inductor": "its __init__ imports standalone_compile, hence all of Dynamo; vLLM's "
                       "config only needs custom_graph_pass's base class",
}
STUBS = {
    "vllm.env_override": "Inductor monkeypatches and CUDA/ROCm library paths for compiled "
                         "engines",
    "transformers.models.auto.image_processing_auto": "image processor configs (vLLM's "
                                                      "config imports one function)",
    "transformers.models.auto.modeling_auto": "the auto-model factory (vLLM's config reads "
                                              "its name table only for a config.json "
                                              "without `architectures`)",
    "transformers.models.auto.tokenization_auto": "tokenizer configs (vLLM's config imports "
                                                  "one function; the trace skips the "
                                                  "tokenizer)",
    "vllm.transformers_utils.s3_utils": "S3 listing for the sharded-state loader (boto3)",
    "vllm.distributed.device_communicators.pynccl_allocator": "NCCL's CUDA-graph memory "
                                                              "pool, built with torch's C++ "
                                                              "extension loader (setuptools)",
    "vllm.connections": "HTTP clients for fetching media and assets",
    "torch._dynamo": "Dynamo, imported only by `vllm.compilation.decorators` (for a class it "
                     "uses when compiling a model's forward; a trace builds models eagerly "
                     "and runs no forward)",
    "torch._dynamo.symbolic_convert": "the class `vllm.compilation.decorators` imports from "
                                      "Dynamo (see torch._dynamo)",
    "torch.fx.experimental.symbolic_shapes": "symbolic shapes (and sympy): torch's "
                                             "meta kernels ask it about plain ints and bools "
                                             "only (`FAKES`), a meta trace has no symbolic "
                                             "sizes",
    "integrations.vllm": "rdma-plan's own vLLM plugin (the `rdma_plan` weight-transfer "
                         "backend, with the executor and the plan format): vLLM loads it with "
                         "its general plugins; it registers no model, layer or loader (`FAKES`)",
    "sympy": "symbolic algebra (with mpmath), imported by torch's type promotion only "
             "to ask whether an argument is a `sympy.Basic`: none can be while sympy is not "
             "imported (`FAKES`)",
}
STUB_TREES = {
    "vllm.entrypoints": "the OpenAI-compatible server and its tools",
    "vllm.reasoning": "reasoning-output parsers",
    "vllm.parser": "tool and reasoning parsers",
    "vllm.v1.request": "scheduler requests",
    "vllm.v1.structured_output": "grammar-constrained decoding",
    "vllm.multimodal.audio": "audio decoding (scipy.signal)",
    "vllm.multimodal.media": "image/video/audio media loaders",
    "vllm.transformers_utils.processor": "HF processors (transformers' processing and "
                                         "modeling utils)",
}


class _StubMeta(type):
    def _miss(cls, what: str) -> LeanMiss:
        return LeanMiss(f"{what} {cls.__module__}.{cls.__qualname__}, left out by the lean "
                        "import of vLLM")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise cls._miss("called")

    def __instancecheck__(cls, obj: Any) -> bool:
        raise cls._miss("isinstance against")

    def __subclasscheck__(cls, sub: Any) -> bool:
        raise cls._miss("issubclass against")

    def __bool__(cls) -> bool:
        raise cls._miss("truth of")

    def __iter__(cls) -> Any:
        raise cls._miss("iterated")

    def __len__(cls) -> int:
        raise cls._miss("len of")

    def __contains__(cls, item: Any) -> bool:
        raise cls._miss("membership in")

    def __getitem__(cls, item: Any) -> Any:
        return cls  # a generic in an annotation: `Placeholder[int]`


def _placeholder_getattr(module: ModuleType) -> Any:
    def __getattr__(name: str) -> Any:  # noqa: N807 (a module's attribute hook)
        if name.startswith("__"):
            raise AttributeError(name)
        path = getattr(module, "__path__", None)
        if path and importlib.machinery.PathFinder.find_spec(f"{module.__name__}.{name}",
                                                             path) is not None:
            return importlib.import_module(f"{module.__name__}.{name}")
        stub = _StubMeta(name, (), {"__module__": module.__name__, "__qualname__": name})
        setattr(module, name, stub)
        return stub

    return __getattr__


class _Loader(importlib.abc.Loader):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        real = None
        if self.kind != "tree":
            parent = sys.modules[name.rpartition(".")[0]].__path__ if "." in name else None
            real = importlib.machinery.PathFinder.find_spec(name, parent)
        module.__path__ = list(real.submodule_search_locations or []) if real else []
        if self.kind == "skip":
            if real is None or real.origin is None:
                raise LeanMiss(f"{name} not found")
            module.__file__ = real.origin
        else:
            module.__getattr__ = _placeholder_getattr(module)  # type: ignore[method-assign]
            for attr, value in FAKES.get(name, {}).items():
                setattr(module, attr, value)
        _Finder.used.add(name)


class _Finder(importlib.abc.MetaPathFinder):
    used: set[str] = set()
    """What it replaced so far (for tests and the benchmark)."""

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in PATCHES:
            return _patched(name, path)
        if name in SKIP_INIT:
            kind = "skip"
        elif name in STUBS:
            kind = "stub"
        elif any(name == t or name.startswith(t + ".") for t in STUB_TREES):
            kind = "tree"
        else:
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(kind), is_package=True)


def _patched(name: str, path: Any) -> importlib.machinery.ModuleSpec | None:
    """The real module's spec, its loader made to apply `PATCHES[name]` once the module has
    run (the loader is this module's own: the file finder makes one per module)."""
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    run = spec.loader.exec_module

    def exec_module(module: ModuleType) -> None:
        run(module)
        PATCHES[name](module)
        _Finder.used.add(name)

    spec.loader.exec_module = exec_module  # type: ignore[method-assign]
    return spec


_LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
"""Where `str.splitlines` ends a line."""


def _fetch_all_from_the_end(module: ModuleType) -> None:
    """transformers' `fetch__all__` (the `__all__` list of a source file, read from the last
    line that starts with `__all__`; transformers' package init runs it over ~3,000 model
    files, splitting each into lines and testing every line) given only the text from that
    line on: found from the end, the same answer for every text (tests/planner/layouts/
    test_vllm_lean.py checks every file of the installed transformers)."""
    whole = module.fetch__all__

    def fetch__all__(file_content: str) -> list[str]:
        at = len(file_content)
        while (at := file_content.rfind("__all__", 0, at + 6)) > 0:  # one starting before at
            if file_content[at - 1] in _LINE_ENDS:
                break
        return whole(file_content[at:]) if at >= 0 else []

    fetch__all__.whole = whole  # type: ignore[attr-defined]
    module.fetch__all__ = fetch__all__


def _source_without_lines(module: ModuleType) -> None:
    """torch's `_library.utils.get_source` (the "file:line" that registered an op's fake
    kernel, kept for torch's error messages; torch and vLLM register hundreds at import)
    with `inspect.getframeinfo(frame, context=0)`: the same file and line, without reading
    the file's source for context lines it drops."""

    def get_source(stacklevel: int) -> str:
        frame = inspect.getframeinfo(sys._getframe(stacklevel), context=0)
        return f"{frame.filename}:{frame.lineno}"

    get_source.whole = module.get_source  # type: ignore[attr-defined]
    module.get_source = get_source


EXPERT_MAP_UNLOGGED = "(not built by the lean import)"


def _expert_map_unlogged(module: ModuleType) -> None:
    """vLLM's `ExpertMapManager.get_compressed_map_string` (every local expert's global
    index as text, two `.item()` calls each, built for every MoE layer of every traced rank;
    its only caller passes it to an `info_once` log line, and the tracer logs errors only)
    answering `EXPERT_MAP_UNLOGGED` (tests/planner/layouts/test_vllm_lean.py checks that
    the installed vLLM has no other caller)."""
    module.ExpertMapManager.get_compressed_map_string = _unlogged


def _unlogged(self: Any) -> str:
    return EXPERT_MAP_UNLOGGED


PATCHES = {"transformers.utils.import_utils": _fetch_all_from_the_end,
           "torch._library.utils": _source_without_lines,
           "vllm.model_executor.layers.fused_moe.expert_map_manager": _expert_map_unlogged}
"""Module -> what is changed in it once it has run: a faster function answering as its own,
or one whose answer only a log line reads."""


def supported() -> bool:
    """Whether the installed vLLM, torch and transformers are the versions the lists
    above were measured against."""
    try:
        return all(importlib.metadata.version(d).startswith(v) for d, v in VERSIONS.items())
    except importlib.metadata.PackageNotFoundError:
        return False


def install() -> bool:
    """Make this process's later imports of vLLM lean; False (nothing done) when vLLM, torch
    or Inductor is already imported, or the versions are not `VERSIONS` (with a warning)."""
    if not supported():
        log.warning("the lean import of vLLM is off: it was written for %s; vLLM is "
                    "imported whole", ", ".join(f"{d} {v}x" for d, v in VERSIONS.items()))
        return False
    if any(m in sys.modules for m in ("vllm", "torch._inductor", *SKIP_INIT, *STUBS)):
        return False
    sys.meta_path.insert(0, _Finder())
    compile_hints_off()
    return True


def used() -> set[str]:
    """The modules the lean import replaced in this process."""
    return set(_Finder.used)
