"""The house's structural rules, read statically from the shipped packages' source.

- no import cycle at any level: between modules, and between the children (modules and
  subpackages) of every package, the top level included (every ``import`` counts,
  module-level or inside a function, ``TYPE_CHECKING`` included);
- layering: a top-level package imports only the packages below it (``LAYERS``): ``schemas``
  nothing, ``planner`` and ``executor`` ``schemas`` only, ``integrations`` ``schemas`` and
  ``executor``, ``harness`` (the kit scripts and benchmarks share) any of them; inside the
  planner, a subpackage imports only the parts of the planner ``INNER`` gives it (the
  layouts are a leaf: the model spec, its errors and the collector pause only; the
  compiler's passes and the plan tools sit beside each other, neither importing the
  other's driver) and is imported only by those
  ``USERS`` names (the plan tools by the command line alone);
- no module imports another module's private (underscore) names, or reads one off a module
  it imported: a name shared across modules is public in its owner;
- no shipped module imports ``tests``;
- no broad handler (bare ``except``, ``except Exception``/``BaseException``) whose body does
  nothing (``pass``, ``continue``, ``...``, a bare ``return``): a swallowed error must be logged
  or re-raised (``executor.cleanup.best_effort`` is the one place that logs and swallows).

No line count: a file is cut where its concerns part, never to meet a number.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS: dict[str, set[str]] = {
    "schemas": set(),
    "planner": {"schemas"},
    "executor": {"schemas"},
    "integrations": {"schemas", "executor"},
    "harness": {"schemas", "planner", "executor", "integrations"},
}
"""Each shipped top-level package -> the packages it may import."""
PACKAGES = tuple(LAYERS)
INNER: dict[str, set[str]] = {
    "planner.layouts": {"planner.spec", "planner.models", "planner.errors", "planner.collector"},
    "planner.passes": {"planner.layouts", "planner.spec", "planner.models", "planner.fp8",
                       "planner.frameworks", "planner.rows", "planner.topology",
                       "planner.writes", "planner.collector"},
    "planner.tools": {"planner.passes", "planner.placement", "planner.rows", "planner.topology",
                      "planner.writes", "planner.collector"},
}
"""A planner subpackage -> the other parts of the planner (children of ``planner``) it may
import."""
USERS: dict[str, set[str]] = {"planner.tools": {"planner.cli"}}
"""A planner subpackage -> the only other parts of the planner that may import it."""


def _files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the shipped packages."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _source(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads, relative imports resolved against ``name``."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """The (module, line) pairs that ``name`` imports: a ``from X import y`` names ``X.y`` where
    that is a module of the house, else ``X``. Relative imports are resolved against ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _source(name, is_pkg, node)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in modules else mod, node.lineno))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    files = _files()
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    from_tests: list[str] = []
    for name, path in files.items():
        for target, line in _imports(name, path, modules):
            if target == "tests" or target.startswith("tests."):
                from_tests.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            if target in modules and target != name:
                graph[name].add(target)
    return graph, from_tests


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph, _ = _graph()
    cycles = _cycles(graph)
    detail = [
        " <-> ".join(c) + ": " + "; ".join(
            f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c
        )
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_no_shipped_module_imports_tests() -> None:
    _, from_tests = _graph()
    assert not from_tests, "\n".join(from_tests)


def _children(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """For every package ("" is the top level), the import graph between its children (its
    modules and subpackages): child a -> child b when a module in a imports one in b. An
    import of a package's own ``__init__`` from inside it is no edge between its children."""
    out: dict[str, dict[str, set[str]]] = {}
    for a, targets in graph.items():
        for b in targets:
            pa, pb = a.split("."), b.split(".")
            i = 0
            while i < min(len(pa), len(pb)) and pa[i] == pb[i]:
                i += 1
            if i == len(pa) or i == len(pb):
                continue  # one is the other's package
            level = out.setdefault(".".join(pa[:i]), {})
            ca, cb = ".".join(pa[: i + 1]), ".".join(pb[: i + 1])
            level.setdefault(ca, set()).add(cb)
            level.setdefault(cb, set())
    return out


def test_children_finds_a_package_cycle() -> None:
    g = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set(),
         "p.a": {"p.a.x"}, "p.c": {"p"}, "p": set()}
    levels = _children(g)
    assert _cycles(levels["p"]) == [["p.a", "p.b"]]
    assert "p.c" not in levels["p"]  # importing its own package's __init__ is no edge


def test_no_import_cycles_between_packages() -> None:
    bad = []
    for package, graph in sorted(_children(_graph()[0]).items()):
        for c in _cycles(graph):
            bad.append(f"{package or '(top level)'}: " + " <-> ".join(c) + ": " + "; ".join(
                f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c))
    assert not bad, "import cycles between packages:\n" + "\n".join(bad)


def test_layers() -> None:
    graph, _ = _graph()
    bad = [f"{a} imports {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
           if (top := b.split(".")[0]) != a.split(".")[0] and top not in LAYERS[a.split(".")[0]]]
    assert not bad, "imports against the layers (LAYERS):\n" + "\n".join(bad)


def _part(module: str) -> str:
    """The child of ``planner`` that ``module`` is in (``planner.tools.verify`` ->
    ``planner.tools``), or the top-level package for any other module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "planner" and len(parts) > 1 else parts[0]


def inner_violations(graph: dict[str, set[str]]) -> list[str]:
    """The imports between parts of the planner against ``INNER`` and ``USERS``."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            pa, pb = _part(a), _part(b)
            if pa == pb or not pb.startswith("planner."):
                continue
            if pa in INNER and pb not in INNER[pa]:
                bad.append(f"{a} imports {b} ({pa} may import {sorted(INNER[pa])})")
            if pb in USERS and pa not in USERS[pb]:
                bad.append(f"{a} imports {b} ({pb} is imported by {sorted(USERS[pb])} only)")
    return bad


def test_inner_finder() -> None:
    g = {"planner.layouts.vllm": {"planner.frameworks", "planner.spec"},
         "planner.passes.shadow": {"planner.tools.verify", "planner.writes"},
         "planner.cli": {"planner.tools.verify"}, "planner.tools.verify": {"planner.writes"}}
    assert [line.split(" (")[0] for line in inner_violations(g)] == [
        "planner.layouts.vllm imports planner.frameworks",
        "planner.passes.shadow imports planner.tools.verify",
        "planner.passes.shadow imports planner.tools.verify"]


def test_planner_layers() -> None:
    bad = inner_violations(_graph()[0])
    assert not bad, "imports against the planner's layers (INNER, USERS):\n" + "\n".join(bad)


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def private_uses(source: str, name: str, is_pkg: bool, modules: set[str],
                 where: str = "<src>") -> list[str]:
    """Where module ``name`` imports a private name of another house module
    (``from m import _x``) or reads one off a house module it imported (``m._x``)."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the house module it is
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    bound[a.asname] = a.name
                elif a.name.split(".")[0] in {m.split(".")[0] for m in modules}:
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            mod = _source(name, is_pkg, node)
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
                if mod in modules and mod != name and _private(a.name):
                    out.append(f"{where}:{node.lineno} imports {mod}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in bound:
                mod = ".".join([bound[v.id], *reversed(chain)])
                if mod in modules and mod != name:
                    out.append(f"{where}:{node.lineno} reads {mod}.{node.attr}")
    return out


def test_private_finder() -> None:
    mods = {"p", "p.a", "p.b"}
    src = ("from p.a import _x, y\nfrom . import b\nimport p.a as pa\nimport torch\n"
           "b._z\npa._w\ntorch._C\nb.__dict__\nself._v\n")
    assert private_uses(src, "p.c", False, mods) == [
        "<src>:1 imports p.a._x", "<src>:5 reads p.b._z", "<src>:6 reads p.a._w"]
    assert private_uses("from ._own import q\nfrom p.c import _x\n", "p.c", False, mods) == []


def test_no_private_names_across_modules() -> None:
    files = _files()
    modules = set(files)
    bad = []
    for name, path in files.items():
        bad += private_uses(path.read_text(), name, path.name == "__init__.py", modules,
                            str(path.relative_to(ROOT)))
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


_BROAD = {"Exception", "BaseException"}


def _is_broad(t: ast.expr | None) -> bool:
    if t is None:
        return True
    if isinstance(t, ast.Tuple):
        return any(_is_broad(e) for e in t.elts)
    return isinstance(t, ast.Name) and t.id in _BROAD


def _does_nothing(body: list[ast.stmt]) -> bool:
    for s in body:
        if isinstance(s, (ast.Pass, ast.Continue, ast.Break)):
            continue
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
            continue
        if isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant)):
            continue
        return False
    return True


def silent_broad_handlers(source: str, where: str = "<src>") -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _is_broad(node.type):
            if _does_nothing(node.body):
                out.append(f"{where}:{node.lineno}")
    return out


def test_silent_handler_finder() -> None:
    src = (
        "try:\n    f()\nexcept Exception:\n    pass\n"
        "try:\n    f()\nexcept:\n    return None\n"
        "try:\n    f()\nexcept (OSError, BaseException):\n    continue\n"
        "try:\n    f()\nexcept Exception as e:\n    log(e)\n"
        "try:\n    f()\nexcept OSError:\n    pass\n"
    )
    assert silent_broad_handlers(src) == ["<src>:3", "<src>:7", "<src>:11"]


def test_no_broad_except_passes_silently() -> None:
    silent = []
    for p in _files().values():
        silent += silent_broad_handlers(p.read_text(), str(p.relative_to(ROOT)))
    assert not silent, "broad handlers that swallow silently:\n" + "\n".join(silent)
