"""The house's structural rules, read statically from the shipped packages' source.

- no import cycle between modules of ``schemas/``, ``planner/``, ``executor/``, ``integrations/``
  (every ``import`` counts, module-level or inside a function, ``TYPE_CHECKING`` included);
- no shipped module imports ``tests``;
- no package file over 400 lines;
- no broad handler (bare ``except``, ``except Exception``/``BaseException``) whose body does
  nothing (``pass``, ``continue``, ``...``, a bare ``return``): a swallowed error must be logged
  or re-raised (``executor.cleanup.best_effort`` is the one place that logs and swallows).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "planner", "executor", "integrations")
MAX_LINES = 400


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
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
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


def test_no_package_file_over_400_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in _files().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "\n".join(long)


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
