"""`rdma-plan inspect` states each rank's extra memory for the zero-pause refit's full shadow
(`executor/shadow.py`): a target's bound weight bytes, 0 on a source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from planner.cli import main
from planner.compiler import compile_file
from schemas.plan import STAGING, load_rank

ROOT = Path(__file__).resolve().parents[2]


def rank_row(text: str, rank: int) -> dict[str, str]:
    """Rank `rank`'s row of inspect's rank table, by column name (columns are two or more
    spaces apart)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank  role"))
    head = re.split(r"\s{2,}", lines[i].strip())
    for line in lines[i + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == str(rank):
            return dict(zip(head, cells))
    raise AssertionError(f"no row for rank {rank} in:\n{text}")


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
        row = rank_row(text, r["rank"])
        assert (row["staging"], row["shadow"]) == (f"{r['staging']:,}", f"{weights:,}")
    largest = max(r["shadow"] for r in targets) / 2**20
    assert f"full shadow (executor/shadow.py) + {largest:.1f} MiB" in text


def test_inspect_shows_each_modes_extra_memory_per_rank(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    # paused 0; full shadow: the bound weights; chunked: the budget N (the one buffer every
    # chunk lands in, executor/chunked.py); a plan compiled without one: None, "-"
    budget = 1 << 20
    text = (ROOT / "plans" / "demo.yaml").read_text().replace(
        "  replicas: 2\n", f"  replicas: 2\n  shadow: {{budget_bytes: {budget}}}\n")
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(text.replace("models/", str(ROOT / "plans" / "models") + "/"))
    plain, chunked = str(tmp_path / "plain.rplan"), str(tmp_path / "chunked.rplan")
    compile_file(str(ROOT / "plans" / "demo.yaml"), plain)
    assert main(["compile", str(cfg), "-o", chunked]) == 0
    capsys.readouterr()
    assert main(["inspect", plain, "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert main(["inspect", plain]) == 0
    out = capsys.readouterr().out
    for r in ranks:
        mem = r["extra_memory"]
        assert mem["paused"] == 0 and mem["full_shadow"] == r["shadow"]
        if r["role"] == "target":
            row = rank_row(out, r["rank"])
            assert mem["chunked_shadow"] is None
            assert (row["shadow"], row["chunked"]) == (f"{r['shadow']:,}", "-")
    full = {r["rank"]: r["shadow"] for r in ranks}
    assert main(["inspect", chunked, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["chunked_budget"] == budget and len(s["chunks"]) >= 2
    for r in s["ranks"]:
        mem = r["extra_memory"]
        want = budget if r["role"] == "target" else 0
        assert mem == {"paused": 0, "full_shadow": full[r["rank"]], "chunked_shadow": want}
    assert main(["inspect", chunked]) == 0
    out = capsys.readouterr().out
    assert f"chunked shadow + {budget / 2**20:.1f} MiB" in out and "mixed-version" in out
