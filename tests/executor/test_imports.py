"""Package boundaries of executor/ (ARCHITECTURE.md): no planner, networkx or yaml; no
pickle; transports do not import each other (only `base` and the shared `torch_copy`)."""

from __future__ import annotations

import ast
import os

from harness.launch import ROOT

EXECUTOR = os.path.join(ROOT, "executor")


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def _files():
    for d, _, files in os.walk(EXECUTOR):
        yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def test_executor_imports_no_planner_networkx_yaml_or_pickle():
    for path in _files():
        for name in _imports(path):
            root = name.lstrip(".").split(".")[0]
            assert root not in {"planner", "networkx", "yaml", "pickle"}, (path, name)


def test_transports_do_not_import_each_other():
    # helpers, not transports
    allowed = {".base", ".torch_copy", ".shm_mailbox", ".options", ".ipc_regions",
               ".ipc_signals", ".ipc_posted", ".ipc_modes", ".local_mailbox", "..cleanup",
               "..errors", "..gpu.graphs", "..gpu.copy_kernel", "..gpu.cuda_runtime"}
    for f in os.listdir(os.path.join(EXECUTOR, "transports")):
        if f.endswith(".py") and f != "__init__.py":  # the registry names them all
            rel = {n for n in _imports(os.path.join(EXECUTOR, "transports", f))
                   if n.startswith(".")}
            assert rel <= allowed, (f, rel - allowed)


def test_gpu_primitives_import_nothing_above_them():
    """executor/gpu/ sits below the interpreter and the transports: it imports only its own
    modules (and the one logging helper, `cleanup.best_effort`)."""
    gpu = os.path.join(EXECUTOR, "gpu")
    for f in os.listdir(gpu):
        if f.endswith(".py"):
            rel = {n for n in _imports(os.path.join(gpu, f)) if n.startswith(".")}
            house = {n for n in _imports(os.path.join(gpu, f))
                     if n.split(".")[0] in {"executor", "integrations", "harness"}}
            assert not house, (f, house)
            assert all(n == "..cleanup" or not n.startswith("..") for n in rel), (f, rel)
