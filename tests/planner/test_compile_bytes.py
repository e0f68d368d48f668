"""`rdma-plan compile` writes the same bytes it wrote when `compile_bytes.json` was made: every
shipped config (plans/*.yaml, plans/published/*.yaml), and shadow (full) and chunked
variants of small ones, chunked plans signed and not. A change to the compiler that
should leave plans as they are (a refactor, a speed-up) keeps this test green; one that
changes plans on purpose regenerates the digests, and says so in its commit:

    PYTHONPATH=$PWD python -m tests.planner.test_compile_bytes --write [NAME ...]

The large configs (seconds to minutes to compile) are in the opt-in profile.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from planner.cli import main
from tests.support.shipped import CONFIGS, shipped_param

DIGESTS = Path(__file__).with_name("compile_bytes.json")
KEY = b"compile-bytes test key, 32 bytes"
QUICK = {"demo.yaml", "demo-moe.yaml", "qwen3-8b_megatron-tp2_vllm-tp2.yaml",
         "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml", "qwen3-4b_dp8_to_vllm-tp8.yaml"}
"""Shipped configs that compile in a few seconds."""
VARIANTS: dict[str, tuple[str, object, bool]] = {
    # name: (shipped config, target.shadow, signed)
    "demo.yaml+shadow": ("demo.yaml", "full", False),
    "demo.yaml+chunked-1MiB": ("demo.yaml", {"budget_bytes": 1 << 20}, False),
    "demo.yaml+chunked-1MiB+signed": ("demo.yaml", {"budget_bytes": 1 << 20}, True),
    "demo-moe.yaml+chunked-2MiB": ("demo-moe.yaml", {"budget_bytes": 2 << 20}, False),
    "qwen3-8b_megatron-tp2_vllm-tp2.yaml+chunked-2GiB":
        ("qwen3-8b_megatron-tp2_vllm-tp2.yaml", {"budget_bytes": 2 << 30}, False),
}
"""Shadow and chunked plans of shipped configs (`target.shadow` added)."""


def _config(name: str, folder: str) -> Path:
    """The config file of case `name`: a shipped one, or a variant written into `folder`."""
    if name not in VARIANTS:
        return next(p for p in CONFIGS if p.name == name)
    base, shadow, _ = VARIANTS[name]
    path = next(p for p in CONFIGS if p.name == base)
    data = yaml.safe_load(path.read_text())
    data["model"]["config"] = str(path.parent / data["model"]["config"])
    data["target"]["shadow"] = shadow
    out = Path(folder) / "config.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def compile_digest(name: str) -> str:
    """blake2b of the plan file `rdma-plan compile` writes for case `name`."""
    with tempfile.TemporaryDirectory() as d:
        plan = os.path.join(d, "p.rplan")
        args = ["compile", str(_config(name, d)), "-o", plan]
        if name in VARIANTS and VARIANTS[name][2]:
            key = os.path.join(d, "key")
            Path(key).write_bytes(KEY)
            args += ["--sign-key", key]
        assert main(args) == 0
        return hashlib.blake2b(Path(plan).read_bytes(), digest_size=16).hexdigest()


def _cases() -> list[object]:
    quick = QUICK | {v for v, (base, _, _) in VARIANTS.items() if base in QUICK
                     and "qwen3-8b" not in v}
    return [*(shipped_param(p, quick) for p in CONFIGS),
            *(pytest.param(v, id=v, marks=[] if v in quick else [pytest.mark.extended])
              for v in VARIANTS)]


@pytest.mark.parametrize("case", _cases())
def test_compile_writes_the_recorded_bytes(case: object) -> None:
    name = case.name if isinstance(case, Path) else str(case)
    recorded = json.loads(DIGESTS.read_text())
    assert name in recorded, f"{name}: no recorded digest; run this module with --write {name}"
    assert compile_digest(name) == recorded[name], (
        f"{name}: the plan's bytes changed; if that is meant, regenerate the digests "
        "(see this module's docstring)")


def test_a_changed_config_changes_the_digest() -> None:
    """The digest sees a change of the plan: a shadow section is a different file."""
    assert compile_digest("demo.yaml") != compile_digest("demo.yaml+shadow")


if __name__ == "__main__":  # --write [NAME ...]: record the digests of those cases (or all)
    if sys.argv[1:2] != ["--write"]:
        sys.exit("usage: python -m tests.planner.test_compile_bytes --write [NAME ...]")
    names = sys.argv[2:] or [p.name for p in CONFIGS] + list(VARIANTS)
    digests = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    for n in names:
        digests[n] = compile_digest(n)
        print(n, digests[n], flush=True)
        DIGESTS.write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
