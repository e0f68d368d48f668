"""A `Case` as plain JSON (no pickle), so another process can compile the same inputs.

`python -m tests.property.case_io CASE.json OUT.rplan [SOURCES.json]` compiles a case,
writes the plan and (optionally) the digest of every source file of this repository that
the process imported.

`compile_elsewhere` runs that in a fresh interpreter (property 7). The other process
imports the code on disk *now*, this one imported it at start-up: when a file it uses has
changed in between (another engineer's edit in a shared checkout, a fix made while a long
run goes on), the two processes compile with different code and their plans may differ
with no bug in the compiler. `compile_elsewhere` then raises `CheckoutChanged` instead of
returning bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from planner.compiler import compile_layouts
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import spec_from_hf
from schemas.config_load import config_from_dict
from schemas.plan_write import write_plan
from tests.property.strategies import Case, full_spec

_SECTIONS = ("model", "source", "target", "cluster", "options")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGES = ("planner", "schemas", "executor", "tests")


def source_digests(root: str = ROOT) -> dict[str, str]:
    """blake2b of every `.py` file of the packages this repository imports, by path
    relative to `root`."""
    out = {}
    for pkg in _PACKAGES:
        for folder, _, names in os.walk(os.path.join(root, pkg)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, "rb") as f:
                        out[os.path.relpath(path, root)] = hashlib.blake2b(f.read()).hexdigest()
    return out


SOURCES_AT_IMPORT = source_digests()
"""The code as this process found it when it imported the suite (pytest imports every
module of the compiler during collection, before the first example runs)."""


def _loaded_sources() -> dict[str, str]:
    """Digests of the files of this repository's packages that this process has imported,
    wherever they were imported from, keyed like `source_digests`."""
    out = {}
    for key, mod in sorted(sys.modules.items()):
        name = getattr(getattr(mod, "__spec__", None), "name", None) or key  # __main__
        path = getattr(mod, "__file__", None)
        if name.split(".")[0] not in _PACKAGES or not path:
            continue
        tail = "__init__.py" if os.path.basename(path) == "__init__.py" else None
        rel = os.path.join(*name.split("."), tail) if tail else \
            os.path.join(*name.split(".")) + ".py"
        with open(path, "rb") as f:
            out[rel] = hashlib.blake2b(f.read()).hexdigest()
    return out


class CheckoutChanged(RuntimeError):
    """The other process imported code that differs from this process's: its plan says
    nothing about determinism."""

    def __init__(self, files: list[str]) -> None:
        super().__init__(f"{', '.join(files)} changed on disk since this process imported "
                         "it: the other process compiled other code; re-run the test")
        self.files = files


def _layout_data(layout: Layout) -> dict[str, Any]:
    return {"side": layout.side, "framework": layout.framework, "replicas": layout.replicas,
            "ranks": [[rl.rank, rl.replica,
                       [[pt.name, list(pt.shape), pt.dtype,
                         [[p.tensor, list(p.offsets), list(p.sizes), list(p.at),
                           None if p.dims is None else list(p.dims)] for p in pt.pieces],
                         pt.buffer]
                        for pt in rl.tensors]] for rl in layout.ranks]}


def _layout(data: dict[str, Any]) -> Layout:
    ranks = tuple(RankLayout(r, rep, tuple(
        PhysicalTensor(name, tuple(shape), dtype, tuple(
            Piece(t, tuple(o), tuple(s), tuple(a), None if d is None else tuple(d))
            for t, o, s, a, d in pieces), buffer)
        for name, shape, dtype, pieces, buffer in tensors))
        for r, rep, tensors in data["ranks"])
    return Layout(data["side"], data["framework"], ranks, data["replicas"])


def case_json(case: Case) -> str:
    cfg = dataclasses.asdict(case.cfg)
    cfg["model"]["overrides"] = dict(case.cfg.model.overrides)  # YAML gives a mapping
    return json.dumps({"hf": case.hf, "config": {k: cfg[k] for k in _SECTIONS},
                       "src": _layout_data(case.src), "dst": _layout_data(case.dst)})


def case_from_json(text: str) -> Case:
    data = json.loads(text)
    cfg = config_from_dict(data["config"])
    return Case(full_spec(spec_from_hf(data["hf"]), cfg), _layout(data["src"]),
                _layout(data["dst"]), cfg, data["hf"])


def compile_elsewhere(case: Case, hash_seed: str = "12345", root: str = ROOT,
                      reference: dict[str, str] | None = None) -> bytes:
    """The plan file of `case` compiled in a fresh interpreter (code under `root`, its
    `PYTHONHASHSEED` set). Raises `CheckoutChanged` when a file the other process imported
    differs from `reference` (default: the code as this process imported it)."""
    reference = SOURCES_AT_IMPORT if reference is None else reference
    with tempfile.TemporaryDirectory() as tmp:
        case_path, out, sources = (os.path.join(tmp, n) for n in ("case.json", "p.rplan",
                                                                    "sources.json"))
        with open(case_path, "w", encoding="utf-8") as f:
            f.write(case_json(case))
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": root}
        subprocess.run([sys.executable, "-m", "tests.property.case_io", case_path, out,
                        sources], check=True, env=env, cwd=root, timeout=120)
        with open(sources, encoding="utf-8") as f:
            loaded = json.load(f)
        changed = [p for p, digest in loaded.items() if reference.get(p) != digest]
        if changed:
            raise CheckoutChanged(changed)
        with open(out, "rb") as f:
            return f.read()


def main(argv: list[str]) -> None:
    with open(argv[0], encoding="utf-8") as f:
        case = case_from_json(f.read())
    write_plan(argv[1], compile_layouts(case.cfg, case.spec, case.src, case.dst))
    if len(argv) > 2:
        with open(argv[2], "w", encoding="utf-8") as f:
            json.dump(_loaded_sources(), f)


if __name__ == "__main__":
    main(sys.argv[1:])
