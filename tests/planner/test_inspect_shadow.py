"""`rdma-plan inspect` states each rank's extra memory for the zero-pause refit's full shadow
(`executor/shadow.py`): a target's bound weight bytes, 0 on a source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.compiler import compile_file
from schemas.plan import STAGING, load_rank

ROOT = Path(__file__).resolve().parents[2]


def test_inspect_shows_each_ranks_full_shadow_bytes(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    plan = str(tmp_path / "p.rplan")
    compile_file(str(ROOT / "plans" / "demo-moe.yaml"), plan)
    assert main(["inspect", plan, "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert main(["inspect", plan]) == 0
    text = capsys.readouterr().out
    targets = [r for r in ranks if r["role"] == "target"]
    assert targets and all(r["shadow"] == 0 for r in ranks if r["role"] == "source")
    for r in targets:
        rp = load_rank(plan, r["rank"])[1]
        weights = sum(g.nbytes for g in rp.regions if g.name != STAGING)
        assert r["shadow"] == weights > 0
        assert f"{r['staging']:>12,}{weights:>16,}" in text
    assert f"+ {max(r['shadow'] for r in targets) / 2**20:.1f} MiB on the largest" in text
