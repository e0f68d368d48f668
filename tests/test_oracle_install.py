"""A missing oracle: a skip naming the install command for a user, a failure under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import oracles

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
from tests.support import oracles
oracles.EXACT.add("pytest")
oracles.ORACLES["ghost"] = oracles.Oracle({module!r}, "import {module}", pinned={pinned!r})
oracles.require("ghost")

def test_needs_the_ghost():
    pass
'''


def run(tmp_path: Path, ci: bool, module: str = "no_such_oracle_pkg",
        pinned: str = "") -> tuple[int, str]:
    test = tmp_path / "test_ghost.py"
    test.write_text(MODULE.format(module=module, pinned=pinned))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci:
        env["CI"] = "true"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(test)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def test_a_missing_oracle_is_skipped_with_the_install_command(tmp_path: Path) -> None:
    rc, out = run(tmp_path, ci=False)
    assert rc in (0, 5), out  # 5: the module's only test skipped at collection
    assert "1 skipped" in out and "bash scripts/setup.sh --test" in out, out


def test_a_missing_oracle_fails_under_ci(tmp_path: Path) -> None:
    rc, out = run(tmp_path, ci=True)
    assert rc != 0, out
    assert "install step is missing" in out and "no_such_oracle_pkg" in out, out


def test_a_wrong_pinned_version_counts_as_missing(tmp_path: Path) -> None:
    rc, out = run(tmp_path, ci=True, module="pytest", pinned="pytest==0.0.1")
    assert rc != 0 and "pytest==0.0.1 (found" in out, out
    rc, out = run(tmp_path, ci=True, module="pytest")
    assert rc == 0, out
    rc, out = run(tmp_path, ci=True, module="pytest", pinned="no-such-dist==1.0")
    assert rc != 0 and "no-such-dist==1.0 (found none)" in out, out


def test_pins_read_a_requirements_file() -> None:
    pins = oracles.pins(oracles.REQS / "requirements-sglang.txt")
    assert pins["sglang"] == "0.5.23"
