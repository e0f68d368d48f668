"""`scripts/demo.py --transport local` when a step goes wrong: the demo says
why (which step, which rank, a timeout or the tensors that differ) and exits non-zero.

Faults are injected in a real run of the demo's CLI (a child process that patches the
executor, then calls the demo's `main`): a DONE to rank 3 is dropped in the demo's step 1
(rank 3 times out: a lost message, what a reported run most likely hit), and after rank 2's
step 2 one byte of its first region is flipped (a target holding wrong bytes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FAULTS = r"""
import sys
sys.path.insert(0, {root!r})
from executor import signals
from executor.core import Executor
from executor.transports.local import LocalTransport
from schemas.plan import DONE

notify, run, dropped = LocalTransport.notify, Executor.run, []

def lossy_notify(self, peer, msg):
    _, _, step, _, kind, _, _ = signals._BODY.unpack_from(msg, 12)
    if peer == 3 and kind == DONE and step == 2 and not dropped:  # the demo's step 1
        dropped.append(msg)
        return
    notify(self, peer, msg)

def corrupting_run(self, step=None):
    stats = run(self, step)
    if self.rank == 2 and self.step == 3:  # the demo's step 2
        self.regions[0][0] ^= 1
    return stats

LocalTransport.notify, Executor.run = lossy_notify, corrupting_run
sys.argv = ["demo.py", "--transport", "local", "--steps", "3", "--timeout-s", "3"]
sys.path.insert(0, {scripts!r})
import demo
sys.exit(demo.main())
"""


def test_the_local_demo_says_which_step_and_rank_went_wrong_and_exits_non_zero():
    code = _FAULTS.format(root=ROOT, scripts=os.path.join(ROOT, "scripts"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=400, env={**os.environ, "PYTHONPATH": ROOT})
    out = res.stdout
    tail = out[-3000:] + res.stderr[-2000:]
    assert res.returncode == 1, tail
    assert "bit-exact after every step: NO" in out, tail
    why = out[out.index("why:"):].splitlines()[1:]
    assert re.match(r"\s+step 1, rank 3 \(target\): timed out: PeerTimeoutError: rank 3: "
                    r"peer rank \d did not send DONE", why[0]), tail
    wrong = [ln for ln in why if re.match(r"\s+step 2, rank 2 \(target\): 1 of \d+ tensors "
                                          r"differ: model\.", ln)]
    assert wrong, tail
