"""The setup scripts' progress lines (`scripts/progress.sh`): a line per step, a line while a
step runs on, the time taken at the end; a nested script reports through the outer ticker;
a failing step still fails the script and stops the ticker."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "s.sh"
    script.write_text(f"set -euo pipefail\n. {ROOT}/scripts/progress.sh setup\n{body}\n")
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "RDMA_PLAN_PROGRESS_EVERY": "1",
                               "TMPDIR": str(tmp_path)})


def test_steps_ticks_and_the_time_taken(tmp_path: Path) -> None:
    r = _run('step "waiting"\nsleep 2.5\nstep "quick"\ndone_in', tmp_path)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert lines[0] == "setup: [0 s] waiting"
    assert any(line.endswith("] still at setup: waiting") for line in lines[1:-2]), lines
    assert lines[-2].endswith("] quick") and lines[-1].startswith("setup: done in 0 min ")
    assert not list(tmp_path.glob("rdma-plan-setup.*"))  # the ticker's state file is gone


def test_a_nested_script_reports_through_the_outer_ticker(tmp_path: Path) -> None:
    inner = tmp_path / "inner.sh"
    inner.write_text(f'set -euo pipefail\n. {ROOT}/scripts/progress.sh inner\n'
                     'step "inner work"\nsleep 2.5\ndone_in\n')
    r = _run(f'step "outer"\nbash {inner}\ndone_in', tmp_path)
    assert r.returncode == 0, r.stderr
    ticks = [line for line in r.stdout.splitlines() if " still at " in line]
    assert ticks and all(line.startswith("setup: [") for line in ticks)  # one ticker
    assert any(line.endswith("still at inner: inner work") for line in ticks), ticks


def test_a_failing_step_fails_the_script(tmp_path: Path) -> None:
    r = _run('step "bad"\nfalse\nstep "never"', tmp_path)
    assert r.returncode == 1 and "never" not in r.stdout
    assert not list(tmp_path.glob("rdma-plan-setup.*"))
