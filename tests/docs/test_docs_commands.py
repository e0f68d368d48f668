"""Every command of README.md and docs/ runs as written.

Each ```bash block is read out of the page (a line a command; a trailing `\\` continues it;
`#` comments dropped by bash itself). The cheap commands (`CHEAP`: the `rdma-plan` CLI, key
files, `export`, `scripts/live-python --where`) run for real, page by page in one scratch
folder that sees the repository's `plans/`, `scripts/` and `examples/`, each block's
commands in order, exactly as written: a command that fails fails the test with its output.
The costly ones (`COSTLY`: setup, the demo, pytest, the live RL loop, an SGLang server, a CI
rehearsal) have tests of their own; here every repository path they name must exist.
`TEMPLATE` commands need the reader's cluster (an engine on their model and GPUs). A command
in none of the lists fails the test: a new page's commands get classified, not skipped.
The model x layout table of docs/models.md is checked against the layouts' own lists.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if p.name != "benchmarks-history.md"]  # a dated record, not usage

CHEAP = ("rdma-plan ", "head -c 32 /dev/urandom > ", "export ", "scripts/live-python --where")
TEMPLATE = ("VLLM_SERVER_DEV_MODE=1 vllm serve /models/my-model ",)
"""A command for the reader's own cluster (their model path, their GPUs): shown as the shape of
what `examples/rl_loop/run.py` runs on CPU (`vllm.entrypoints.openai.api_server`, the same
arguments); not run here."""
COSTLY = ("bash scripts/setup.sh", "python3 scripts/demo.py", "python3 -m pytest",
          "bash scripts/test_under_load.sh",
          "scripts/live-python examples/rl_loop/", "python3 -m sglang.launch_server",
          "mkdir -p /tmp/snap && git archive HEAD")

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def bash_commands(page: Path) -> list[list[str]]:
    """The commands of each ```bash block of `page`, in order."""
    blocks: list[list[str]] = []
    block: list[str] | None = None
    pending = ""
    for line in page.read_text().splitlines():
        if block is None:
            if line.strip() == "```bash":
                block = []
            continue
        if line.strip() == "```":
            blocks.append(block)
            block = None
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        if text and not text.startswith("#"):
            block.append(text)
    return blocks


def _kind(command: str) -> str:
    if command.startswith(CHEAP):
        return "cheap"
    if command.startswith(TEMPLATE):
        return "template"
    if command.startswith(COSTLY) or command.removeprefix("bash ").startswith(COSTLY):
        return "costly"
    return "unknown"


PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def test_the_pages_have_commands() -> None:
    # the extraction finds the README's two commands and the CLI page's
    readme = bash_commands(ROOT / "README.md")
    assert readme[:2] == [["bash scripts/setup.sh && python3 scripts/demo.py"],
                          ["bash scripts/setup.sh --test && python3 -m pytest -q"]]
    assert any(c.startswith("rdma-plan compile") for b in bash_commands(ROOT / "docs/cli.md")
               for c in b)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_command_is_known(page: Path) -> None:
    unknown = [c for b in bash_commands(page) for c in b if _kind(c) == "unknown"]
    assert not unknown, (f"{page.name}: commands neither run here (CHEAP) nor checked by a "
                         f"test of their own (COSTLY): {unknown}")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_costly_commands_name_paths_that_exist(page: Path) -> None:
    missing = []
    for c in (c for b in bash_commands(page) for c in b if _kind(c) == "costly"):
        for word in shlex.split(c.split("#")[0]):
            if re.match(r"^(scripts|examples|tests|plans|bench)/", word) and \
                    not (ROOT / word.split("::")[0]).exists():
                missing.append(word)
    assert not missing, f"{page.name}: paths that do not exist: {missing}"


def _rdma_plan() -> str:
    """`rdma-plan` as the user runs it: the installed script, run by this Python (with this
    checkout first on the path)."""
    found = shutil.which("rdma-plan")
    if found:
        return f"{shlex.quote(sys.executable)} {shlex.quote(found)}"
    return f"{shlex.quote(sys.executable)} -m planner"


@pytest.mark.parametrize("page", [p for p in PAGES if any(
    _kind(c) == "cheap" for b in bash_commands(p) for c in b)],
    ids=lambda p: str(p.relative_to(ROOT)))
def test_cheap_commands_run_as_written(page: Path, tmp_path: Path) -> None:
    for name in ("plans", "scripts", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
        MPLBACKEND="Agg")
    for block in bash_commands(page):
        script = [c for c in block if _kind(c) == "cheap"]
        if not script:
            continue
        for c in script:
            run = re.sub(r"^rdma-plan ", _rdma_plan() + " ", c)
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", run], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)
            if c.startswith("scripts/live-python --where") and r.returncode == 2:
                continue  # no live venv here: it says so in one line (its own test below)
            assert r.returncode == 0, f"{page.name}: `{c}` exited {r.returncode}:\n" \
                                      f"{r.stdout[-2000:]}{r.stderr[-2000:]}"
            if "--plot " in c:  # inspect --plot FILE.png: both pictures
                png = c.split("--plot ")[1].split()[0]
                assert (tmp_path / png).stat().st_size > 0
                assert (tmp_path / png.replace(".png", "-traffic.png")).stat().st_size > 0


def test_live_python_names_the_venv_or_says_how_to_make_it(tmp_path: Path) -> None:
    r = subprocess.run([str(ROOT / "scripts/live-python"), "--where"], capture_output=True,
                       text=True, env=dict(os.environ, RDMA_PLAN_CACHE=str(tmp_path)))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        f"live-python: no live venv at {tmp_path}/live-venv; make it with `bash "
        "scripts/setup_live.sh` (or `bash scripts/setup.sh --test`), with the same "
        "RDMA_PLAN_CACHE")
    venv = tmp_path / "elsewhere"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    r = subprocess.run([str(ROOT / "scripts/live-python"), "-c", "print('hi')"],
                       capture_output=True, text=True,
                       env=dict(os.environ, RDMA_PLAN_LIVE_VENV=str(venv)))
    assert (r.returncode, r.stdout) == (0, "hi\n")


def test_the_models_table_matches_the_layouts() -> None:
    from planner.layouts import megatron, sglang, vllm
    from planner.spec import SUPPORTED_MODEL_TYPES

    rows = {}
    for line in (ROOT / "docs/models.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`[a-z0-9_]+`", cells[0]) and \
                cells[1] != "Megatron-Core":
            rows[cells[0].strip("`")] = cells[1:]
    assert sorted(rows) == sorted(SUPPORTED_MODEL_TYPES)
    for family, (mcore, fsdp2, vl, sgl) in rows.items():
        assert (mcore == "yes") == (family in megatron.FAMILIES), family
        assert (sgl == "yes") == (family in sglang.FAMILIES), family
        assert (vl == "yes") == (family in vllm.FAMILIES), family
        assert fsdp2 == ("TP 1" if family == "gpt_oss" else "yes"), family
