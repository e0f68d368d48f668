"""The setup scripts' progress lines (`scripts/progress.sh`): a line per step, a line while a
step runs on, the time taken at the end; a nested script reports through the outer ticker;
a failing step still fails the script and stops the ticker."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "s.sh"
    # stdout is copied to out.txt from the start, the ticker's too, for _until_ticked to read
    script.write_text(f"set -euo pipefail\nexec > >(tee {tmp_path / 'out.txt'})\n"
                      f". {ROOT}/scripts/progress.sh setup\n{body}\n")
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "RDMA_PLAN_PROGRESS_EVERY": "1",
                               "TMPDIR": str(tmp_path)})


def _until_ticked(out: Path, what: str) -> str:
    """Shell lines that wait (up to 50 s, whatever the box's load) for the ticker's first line
    naming `what` in `out`: the test reads the ticker's output, never the clock."""
    return (f'for _ in $(seq 500); do grep -q "still at {what}" {out} && break; sleep 0.1; done')


def test_steps_ticks_and_the_time_taken(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    r = _run(f'step "waiting"\n{_until_ticked(out, "setup: waiting")}\n'
             'step "quick"\ndone_in', tmp_path)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"setup: \[\d+ s\] waiting", lines[0]), lines
    assert any(re.fullmatch(r"setup: \[\d+ s\] still at setup: waiting", line)
               for line in lines[1:-2]), lines
    assert re.fullmatch(r"setup: \[\d+ s\] quick", lines[-2]), lines
    assert re.fullmatch(r"setup: done in \d+ min \d+ s", lines[-1]), lines
    assert not list(tmp_path.glob("rdma-plan-setup.*"))  # the ticker's state file is gone


def test_a_nested_script_reports_through_the_outer_ticker(tmp_path: Path) -> None:
    inner = tmp_path / "inner.sh"
    out = tmp_path / "out.txt"
    inner.write_text(f'set -euo pipefail\n. {ROOT}/scripts/progress.sh inner\n'
                     f'step "inner work"\n{_until_ticked(out, "inner: inner work")}\ndone_in\n')
    r = _run(f'step "outer"\nbash {inner}\ndone_in', tmp_path)
    assert r.returncode == 0, r.stderr
    ticks = [line for line in r.stdout.splitlines() if " still at " in line]
    assert ticks and all(line.startswith("setup: [") for line in ticks)  # one ticker
    assert any(line.endswith("still at inner: inner work") for line in ticks), ticks


def test_a_failing_step_fails_the_script(tmp_path: Path) -> None:
    r = _run('step "bad"\nfalse\nstep "never"', tmp_path)
    assert r.returncode == 1 and "never" not in r.stdout
    assert not list(tmp_path.glob("rdma-plan-setup.*"))
