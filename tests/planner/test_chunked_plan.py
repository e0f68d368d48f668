"""A chunked plan file (`schemas/chunked_plan.py`): `rdma-plan verify` passes the
compiled chunk plans and refuses broken ones; the executor's loader refuses them too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from executor.chunked import ChunkedShadow
from executor.errors import PlanBoundsError
from executor.transports.local import Fabric
from planner.cli import main
from schemas.chunked_plan import load_chunked, write_chunked
from schemas.errors import PlanFormatError
from schemas.shadow import SWITCH_COLUMNS
from schemas.table import Table
from tests.support.shadow_plans import CASES, compile_chunked_file

BUDGET = 1 << 20


def _moved(rp, delta: int):
    """`rp` with its chunked switch ops reading `delta` bytes further into the buffer."""
    s = rp.shadow.switch
    cols = {n: np.array(s[n]) for n, _ in SWITCH_COLUMNS}
    cols["shadow_offset"] = cols["shadow_offset"] + delta
    return dataclasses.replace(rp, shadow=dataclasses.replace(
        rp.shadow, switch=Table.build(SWITCH_COLUMNS, **cols)))


def test_verify_passes_the_compiled_chunks_and_refuses_broken_ones(tmp_path: Path,
                                                                   capsys) -> None:
    path = str(tmp_path / "p.rplan")
    plans = compile_chunked_file(CASES[1], BUDGET, path)
    assert main(["verify", path]) == 0
    assert load_chunked(path)[1][2].ranks[2].shadow.budget == BUDGET
    capsys.readouterr()
    t = next(rp.rank for rp in plans[1].ranks if rp.role == "target")
    # a chunk whose switch reads its tensors elsewhere in the buffer than they were bound
    bad = list(plans)
    bad[1] = dataclasses.replace(plans[1], ranks=tuple(
        _moved(rp, 64) if rp.rank == t else rp for rp in plans[1].ranks))
    moved = str(tmp_path / "moved.rplan")
    write_chunked(moved, bad, BUDGET)
    with pytest.raises(PlanFormatError, match="chunk 1: target rank .* not 0"):
        load_chunked(moved)
    assert main(["verify", moved]) == 2
    assert "not 0" in capsys.readouterr().err
    # the same tensor in two chunks
    twice = str(tmp_path / "twice.rplan")
    write_chunked(twice, [plans[1], *plans[1:]], BUDGET)
    assert main(["verify", twice]) == 1
    assert "is also in chunk 0" in capsys.readouterr().err
    # a flipped byte in a chunk: its digest in the index
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 1
    flipped = tmp_path / "flipped.rplan"
    flipped.write_bytes(bytes(data))
    assert main(["verify", str(flipped)]) == 2
    assert "\n" not in capsys.readouterr().err.strip()
    with pytest.raises((PlanFormatError, PlanBoundsError)):
        ChunkedShadow.load(str(flipped), t, {}, transport="local", rendezvous=Fabric(), timeout_s=2,
                           no_identity=True)


def test_compile_refuses_a_budget_below_the_largest_tensor_in_one_line(tmp_path: Path,
                                                                       capsys) -> None:
    root = Path(__file__).resolve().parents[2]
    text = (root / "plans" / "demo.yaml").read_text().replace(
        "  replicas: 2\n", "  replicas: 2\n  shadow: {budget_bytes: 65536}\n")
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(text.replace("models/", str(root / "plans" / "models") + "/"))
    out = tmp_path / "p.rplan"
    assert main(["compile", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "budget_bytes = 65536" in err and "raise it to at least" in err
    assert not out.exists()


def test_a_signed_chunked_plan_loads_with_its_key_only_and_plain_load_points_to_chunked(
        tmp_path: Path) -> None:
    import executor
    path = str(tmp_path / "p.rplan")
    plans = compile_chunked_file(CASES[0], BUDGET, str(tmp_path / "unsigned.rplan"))
    write_chunked(path, plans, BUDGET, b"k" * 32)
    assert len(load_chunked(path, b"k" * 32)[1]) == len(plans)
    with pytest.raises(PlanFormatError, match="signature does not match"):
        load_chunked(path, b"x" * 32)
    with pytest.raises(PlanFormatError, match="is not signed"):
        load_chunked(str(tmp_path / "unsigned.rplan"), b"k" * 32)
    with pytest.raises(PlanFormatError, match="is a chunked plan") as e:
        executor.load(path, 2, {}, transport="local", rendezvous=Fabric(), no_identity=True)
    assert "\n" not in str(e.value)
