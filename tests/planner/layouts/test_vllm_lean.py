"""The lean import of vLLM (`planner/layouts/vllm_lean.py`): its placeholders refuse every
use a trace could depend on, its finder skips package inits and stubs modules and trees on
fake packages, and `install` declines for other versions or when something it would
replace is already imported. (That lean traces equal whole ones, with real vLLM:
tests/oracles/test_vllm_trace_lean.py.)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from planner.layouts import vllm_lean


def placeholder(name: str = "Thing") -> type:
    return vllm_lean._placeholder_getattr(ModuleType("somewhere"))(name)


@pytest.mark.parametrize("use", [
    lambda p: p(), lambda p: isinstance(1, p), lambda p: issubclass(int, p),
    lambda p: bool(p), lambda p: list(p), lambda p: len(p), lambda p: 1 in p,
])
def test_a_placeholder_refuses_to_be_used(use: object) -> None:
    with pytest.raises(vllm_lean.LeanMiss, match="somewhere.Thing, left out by the lean"):
        use(placeholder())  # type: ignore[operator]


def test_a_placeholder_stands_in_annotations_only() -> None:
    p = placeholder()
    assert p[int] is p and (p | None) is not None  # `Thing[int]`, `Thing | None`
    with pytest.raises(AttributeError):
        p.get_class  # noqa: B018
    with pytest.raises(AttributeError):
        vllm_lean._placeholder_getattr(ModuleType("m"))("__all__")


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def fake_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    boom = "raise RuntimeError('this init must not run')\n"
    write(tmp_path, {"lean_skip/__init__.py": boom, "lean_skip/sub.py": "X = 1\n",
                     "lean_stub/__init__.py": boom, "lean_stub/real.py": "Y = 2\n",
                     "lean_tree/__init__.py": boom, "lean_tree/a/__init__.py": boom,
                     "lean_tree/a/b.py": boom})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm_lean, "SKIP_INIT", {"lean_skip": "test"})
    monkeypatch.setattr(vllm_lean, "STUBS", {"lean_stub": "test"})
    monkeypatch.setattr(vllm_lean, "STUB_TREES", {"lean_tree": "test"})
    monkeypatch.setattr(vllm_lean, "FAKES", {"lean_stub": {"works": len}})
    monkeypatch.setattr(sys, "meta_path", [vllm_lean._Finder(), *sys.meta_path])
    monkeypatch.setattr(vllm_lean._Finder, "used", set())
    for name in list(sys.modules):
        if name.startswith(("lean_skip", "lean_stub", "lean_tree")):
            monkeypatch.delitem(sys.modules, name)
    yield
    for name in list(sys.modules):
        if name.startswith(("lean_skip", "lean_stub", "lean_tree")):
            del sys.modules[name]


@pytest.mark.usefixtures("fake_packages")
def test_the_finder_skips_inits_and_stubs_modules_and_trees() -> None:
    assert importlib.import_module("lean_skip.sub").X == 1  # the package's init never ran
    stub = importlib.import_module("lean_stub")
    assert stub.real.Y == 2  # a real submodule of a stubbed module still imports
    from lean_stub import Missing  # type: ignore[attr-defined]
    with pytest.raises(vllm_lean.LeanMiss):
        Missing()
    from lean_tree.a.b import Anything  # type: ignore[import-not-found]
    with pytest.raises(vllm_lean.LeanMiss):
        isinstance(None, Anything)
    assert vllm_lean.used() == {"lean_skip", "lean_stub", "lean_tree", "lean_tree.a",
                                "lean_tree.a.b"}


def test_other_versions_are_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"vllm": "0.33.0", "torch": "2.13.0+cpu", "transformers": "5.20.2"}
    monkeypatch.setattr(importlib.metadata, "version", lambda d: versions[d])
    assert vllm_lean.supported()
    versions["vllm"] = "0.34.0"
    assert not vllm_lean.supported()

    def missing(d: str) -> str:
        raise importlib.metadata.PackageNotFoundError(d)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert not vllm_lean.supported()


@pytest.mark.usefixtures("fake_packages")
def test_a_stub_gives_its_fakes_and_placeholders_for_the_rest() -> None:
    from lean_stub import Other, works  # type: ignore[attr-defined]
    assert works is len
    with pytest.raises(vllm_lean.LeanMiss):
        Other()


def test_dynamos_disable_gives_back_the_function() -> None:
    def f() -> int:
        return 1

    disable = vllm_lean.FAKES["torch._dynamo"]["disable"]
    assert disable(f, True, wrapping=False) is f and disable()(f) is f


SHAPES = vllm_lean.FAKES["torch.fx.experimental.symbolic_shapes"]
PLAIN = [((True,), "bools"), ((False,), "bools"), ((3,), "ints"), ((0,), "ints"),
         ((True, False), "bools"), ((True, True, True), "bools"), ((2, 3), "ints"),
         (((1, 2), [1, 2]), "lists"), (((1, 2), (1, 3)), "lists"), (((1,), (1, 2)), "lists")]
"""Plain arguments, and which functions take them."""
TAKES = {"bools": {"expect_true", "guard_or_false", "guard_or_true", "statically_known_true",
                   "guard_size_oblivious", "guarding_hint_or_throw", "has_guarding_hint",
                   "is_nested_int", "sym_and", "sym_or"},
         "ints": {"guarding_hint_or_throw", "has_guarding_hint", "is_nested_int", "sym_eq"},
         "lists": {"sym_eq"}}


def test_symbolic_shapes_fakes_answer_as_torchs_for_plain_values() -> None:
    real = pytest.importorskip("torch.fx.experimental.symbolic_shapes")
    if not vllm_lean.supported():
        pytest.skip("torch is not the version the fakes were written from")
    for args, kind in PLAIN:
        for name in TAKES[kind]:
            n = {"sym_eq": 2, "sym_and": None, "sym_or": None}.get(name, 1)
            if n is not None and len(args) != n:
                continue
            assert SHAPES[name](*args) == getattr(real, name)(*args), (name, args)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_symbolic_shapes_fakes_refuse_anything_else(name: str) -> None:
    torch = pytest.importorskip("torch")
    odd = torch.empty(0)  # not a plain int or bool (as a SymInt or SymBool is not)
    with pytest.raises(vllm_lean.LeanMiss):
        SHAPES[name](*([odd, odd] if name == "sym_eq" else [odd]))


def test_sympy_basic_is_a_class_of_nothing() -> None:
    basic = vllm_lean.FAKES["sympy"]["Basic"]
    assert not any(isinstance(x, basic) for x in (1, 1.5, True, "x", None, object()))


@pytest.mark.parametrize("loaded", ["vllm", "torch._inductor", "torch._dynamo",
                                    "transformers.models.auto.modeling_auto"])
def test_install_declines_when_it_comes_too_late(loaded: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_lean, "supported", lambda: True)
    monkeypatch.setitem(sys.modules, loaded, sys.modules.get(loaded) or ModuleType(loaded))
    before = list(sys.meta_path)
    assert vllm_lean.install() is False
    assert sys.meta_path == before


def test_install_declines_other_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_lean, "supported", lambda: False)
    before = list(sys.meta_path)
    assert vllm_lean.install() is False and sys.meta_path == before


def fast_fetch_all() -> tuple:
    module = ModuleType("import_utils")
    module.fetch__all__ = lambda text: ("whole", text)  # type: ignore[attr-defined]
    vllm_lean._fetch_all_from_the_end(module)
    return module.fetch__all__, module.fetch__all__.whole  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "rest"), [
    ("x = 1\n__all__ = ['a']\ny = 2\n__all__ = ['b']\n", "__all__ = ['b']\n"),
    ("__all__ = ['a']", "__all__ = ['a']"),
    ("s = '__all__'\n__all__ = [\n 'a',\n]\n", "__all__ = [\n 'a',\n]\n"),
    ("__all__all__ = 1", "__all__all__ = 1"),  # overlapping: the line starts at 0
    ("x\r__all__ = ['a']\x0c__all__all__", "__all__all__"),
])
def test_transformers_fetch_all_reads_from_the_last_line_starting_with_it(
        text: str, rest: str) -> None:
    fast, _ = fast_fetch_all()
    assert fast(text) == ("whole", rest)
    assert fast("y = '__all__'\n") == [] and fast("nothing") == []


def test_transformers_fetch_all_answers_as_its_own_for_every_installed_file() -> None:
    iu = pytest.importorskip("transformers.utils.import_utils")
    whole = getattr(iu.fetch__all__, "whole", iu.fetch__all__)
    module = ModuleType("import_utils")
    module.fetch__all__ = whole  # type: ignore[attr-defined]
    vllm_lean._fetch_all_from_the_end(module)
    root = Path(iu.__file__).parents[1]
    files = [p.read_text(encoding="utf-8") for p in root.rglob("*.py")]
    assert len(files) > 1000
    assert [module.fetch__all__(t) for t in files] == [whole(t) for t in files]


def test_torchs_get_source_without_lines_names_the_same_file_and_line() -> None:
    utils = pytest.importorskip("torch._library.utils")
    module = ModuleType("utils")
    module.get_source = getattr(utils.get_source, "whole", utils.get_source)  # type: ignore[attr-defined]
    vllm_lean._source_without_lines(module)
    fast, whole = module.get_source, module.get_source.whole  # type: ignore[attr-defined]

    def caller(level: int) -> tuple[str, str]:
        return fast(level), whole(level)

    assert fast(1) == whole(1) and fast(2) == whole(2)  # this line, then pytest's
    here = sys._getframe().f_lineno
    lines = {1: caller.__code__.co_firstlineno + 1, 2: here + 3}  # caller's line, then this
    for level in (1, 2):
        a, b = caller(level)
        assert a == b == f"{__file__}:{lines[level]}"


def test_the_expert_map_string_only_feeds_a_log_line() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not vllm_lean.supported():
        pytest.skip("vLLM is not installed, or not the version the lean import is for")
    root = Path(spec.origin).parent
    uses = [(p.name, line.strip()) for p in root.rglob("*.py")
            for line in p.read_text(encoding="utf-8").splitlines()
            if "get_compressed_map_string" in line]
    assert uses == [("expert_map_manager.py", "self.get_compressed_map_string(),"),
                    ("expert_map_manager.py", "def get_compressed_map_string(self) -> str:")]
    text = (root / "model_executor/layers/fused_moe/expert_map_manager.py").read_text()
    call = text.index("self.get_compressed_map_string(),")
    head = text[text.rindex("logger.info_once(", 0, call):call]  # an argument of that call
    assert head.count("(") - head.count(")") == 1, head


def test_a_patched_module_runs_then_is_patched(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, {"lean_patch.py": "def f():\n    return 1\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm_lean, "PATCHES", {"lean_patch": lambda m: setattr(m, "g", m.f)})
    monkeypatch.setattr(sys, "meta_path", [vllm_lean._Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "lean_patch", raising=False)
    module = importlib.import_module("lean_patch")
    assert module.g() == 1 and module.__file__ == str(tmp_path / "lean_patch.py")
    del sys.modules["lean_patch"]
