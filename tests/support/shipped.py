"""The shipped configs (`plans/*.yaml`, `plans/published/*.yaml`) as test parameters."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([*ROOT.glob("plans/*.yaml"), *ROOT.glob("plans/published/*.yaml")])
TRACED = {"gemma-3-1b_fsdp2-8_vllm-tp1-x8.yaml"}
"""Configs whose target layout is traced (needs vLLM)."""


def shipped_param(path: Path, quick: set[str]) -> object:
    """`path` as a pytest parameter: in the opt-in profile unless its name is in `quick`,
    skipped without vLLM where its layout is traced."""
    marks = [] if path.name in quick else [pytest.mark.extended]
    if path.name in TRACED:
        marks.append(pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                        reason="tracing needs vLLM"))
    return pytest.param(path, id=path.name, marks=marks)
