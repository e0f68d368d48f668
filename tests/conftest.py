"""The suite's groups: every test gets exactly one group marker, from where it lives.

    unit       one process, seconds: schemas, planner passes, layouts, the local executor
    processes  ranks as separate processes (NIXL between processes, the demo, faults,
               the benchmarks' tiny modes)
    property   hypothesis properties of the compiler and the plan (tests/property/)
    oracle     real vLLM / Megatron-Core / FSDP2 / SGLang code on CPU (tests/oracles/)
    gpu        needs CUDA GPUs (run on the device machine)

`pytest -m unit` is the quick loop. Plain `pytest` leaves out the deep profile (`deep`: live
engines, the full fuzz, the blame matrix), unless a `-m` expression is given or a deep test's
file or id is named on the command line; `pytest -m deep` runs it (CI runs both). A test module can
claim a group itself with `pytestmark = pytest.mark.processes` (or any other group).
tests/README.md describes the layout.
"""

from __future__ import annotations

import os

import pytest

# vLLM resolves its platform once, on first use, and a test module's import may be that use:
# with no GPU and no VLLM_TARGET_DEVICE it settles on a platform with no device, which every
# vLLM-on-CPU test then trips over ("Device string must not be empty"). Set before collection.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

GROUPS = ("unit", "processes", "property", "oracle", "gpu")
_BY_DIR = {"property": "property", "oracles": "oracle", "reliability": "processes",
           "bench": "processes", "scripts": "processes"}
_PROCESS_MODULES = {"test_nixl.py", "test_cuda_ipc.py", "test_uccl.py"}


def pytest_configure(config: pytest.Config) -> None:
    for g in GROUPS:
        config.addinivalue_line("markers", f"{g}: test group (see tests/conftest.py)")


def group_of(item: pytest.Item) -> str:
    """The group of a collected test: its own marker first, then where it lives."""
    for g in ("gpu", "oracle", "processes", "property"):
        if item.get_closest_marker(g) is not None:
            return g
    parts = item.path.parts
    where = parts[parts.index("tests") + 1] if "tests" in parts else ""
    if item.path.name in _PROCESS_MODULES:
        return "processes"
    return _BY_DIR.get(where, "unit")


def _named(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the command line names this test's file or id (not only a folder above it)."""
    for arg in config.args:
        path, _, rest = arg.partition("::")
        if (config.invocation_params.dir / path).resolve() != item.path.resolve():
            continue
        if not rest or item.nodeid.split("::", 1)[1].startswith(rest):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        g = group_of(item)
        if item.get_closest_marker(g) is None:
            item.add_marker(getattr(pytest.mark, g))
    if config.option.markexpr:
        return
    keep, deep = [], []
    for item in items:
        if item.get_closest_marker("deep") is not None and not _named(config, item):
            deep.append(item)
        else:
            keep.append(item)
    if deep:
        config.hook.pytest_deselected(items=deep)
        items[:] = keep
