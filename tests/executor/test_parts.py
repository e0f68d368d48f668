"""The executor is composed of parts that own their state (docs/architecture.md): no mixin,
no part importing the executor or reaching into another object's private names, and no
error swallowed silently (`executor/cleanup.py`'s `best_effort` is the one place, and it
logs)."""

from __future__ import annotations

import ast
import logging
import os

from executor.cleanup import best_effort
from executor.core import Executor
from harness.launch import ROOT

EXECUTOR = os.path.join(ROOT, "executor")


def _trees(top_only: bool = False) -> list[tuple[str, ast.Module]]:
    out = []
    for d, _, files in os.walk(EXECUTOR):
        if top_only and d != EXECUTOR:
            continue
        out += [(os.path.relpath(os.path.join(d, f), ROOT),
                 ast.parse(open(os.path.join(d, f)).read()))
                for f in sorted(files) if f.endswith(".py")]
    return out


def test_executor_is_no_mixin() -> None:
    assert Executor.__mro__ == (Executor, object)


def _relative(tree: ast.Module) -> set[str]:
    return {node.module or "" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1}


def test_no_part_imports_the_executor() -> None:
    trees = dict(_trees(top_only=True))
    parts = {m for m in _relative(trees[os.path.join("executor", "core.py")])
             if os.path.join("executor", m + ".py") in trees}
    assert {"waits", "recovery", "window", "blame"} <= parts
    bad = [p for p in parts if "core" in _relative(trees[os.path.join("executor", p + ".py")])]
    assert not bad, f"parts of the executor that import it: {bad}"


def test_no_part_reaches_into_another_objects_private_names() -> None:
    # transports/ wrap torch's private CUDA IPC calls; the executor's own modules do not
    bad = [f"{path}:{node.lineno}: {ast.unparse(node)}" for path, tree in _trees(top_only=True)
           for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and node.attr.startswith("_")
           and not node.attr.startswith("__")
           and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not bad, bad


def _silent(handler: ast.ExceptHandler) -> bool:
    """Neither raises nor uses the error it caught (logs it, keeps it, reports it)."""
    raises = any(isinstance(n, ast.Raise) for b in handler.body for n in ast.walk(b))
    uses = handler.name is not None and any(
        isinstance(n, ast.Name) and n.id == handler.name
        for b in handler.body for n in ast.walk(b))
    return not (raises or uses)


def test_no_error_swallowed_silently() -> None:
    passes, broad = [], []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler):
                where = f"{path}:{node.lineno}"
                if all(isinstance(b, ast.Pass) for b in node.body):
                    passes.append(where)
                caught = "" if node.type is None else ast.unparse(node.type)
                if (node.type is None or "Exception" in caught) and _silent(node) \
                        and not path.endswith("cleanup.py"):
                    broad.append(where)
            if isinstance(node, ast.Attribute) and node.attr == "suppress":
                passes.append(f"{path}:{node.lineno}: contextlib.suppress")
    assert not passes, f"errors ignored without a word (use cleanup.best_effort): {passes}"
    assert not broad, f"a broad except neither raises nor uses its error: {broad}"


def test_best_effort_logs_what_it_swallowed(caplog) -> None:
    def boom(x: int) -> int:
        raise OSError(f"store gone ({x})")

    with caplog.at_level(logging.INFO, logger="executor"):
        assert best_effort("publishing the step", boom, 7, default=-1) == -1
        assert best_effort("adding", lambda a, b: a + b, 2, 3) == 5
    assert [r.getMessage() for r in caplog.records] == [
        "publishing the step failed, ignored: OSError: store gone (7)"]
