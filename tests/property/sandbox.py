"""Run possibly hostile plans in a child process, with guard bytes around every tensor.

The child (`python -m tests.property.sandbox`) serves one request per line on stdin,
`{"plan": path, "case": path}`: it builds the case's tensors (sources from labels,
targets at `SENTINEL`), each inside a larger buffer whose guard bytes before and after
hold `GUARD`, runs `executor.run_all_local` once, and answers one line: the outcome
(`ok` or the exception's class names, message and the file that raised it) and whether
every guard byte is intact. Its address space is capped, so a plan that makes the
executor allocate without bound fails fast instead of swapping.

The parent (`Sandbox`) restarts the child when it dies (a crash) or when a request takes
longer than its timeout (a hang), and reports those as outcomes `crash` / `hang`.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import traceback
from typing import Any

GUARD = 0xA5
GUARD_BYTES = 4096
MEMORY_LIMIT = 8 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sandbox:
    """The parent's handle on one child; `run` returns the child's answer as a dict."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": ROOT}
        return subprocess.Popen([sys.executable, "-m", "tests.property.sandbox"], cwd=ROOT,
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, plan_path: str, case_path: str) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"plan": plan_path, "case": case_path}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return {"outcome": "crash", "detail": "child died before the request"}
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.stop()
            return {"outcome": "hang", "detail": f"no answer within {self.timeout_s} s"}
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.proc = None
            return {"outcome": "crash", "detail": f"child exited with {code}"}
        return json.loads(line)


def _guarded(t: Any) -> tuple[Any, Any]:
    """(a tensor equal to `t` that lives inside a guarded buffer, that buffer)."""
    import torch

    n = t.numel() * t.element_size()
    buf = torch.full((GUARD_BYTES + n + GUARD_BYTES,), GUARD, dtype=torch.uint8)
    inner = buf[GUARD_BYTES:GUARD_BYTES + n].view(t.dtype).view(t.shape)
    inner.copy_(t)
    return inner, buf


def _serve_one(plan_path: str, case_path: str) -> dict[str, Any]:
    import executor
    from tests.property import harness
    from tests.property.case_io import case_from_json

    with open(case_path, encoding="utf-8") as f:
        case = case_from_json(f.read())
    from harness.weights import materialize

    plain = materialize(case.src, harness.labels(case))
    plain.update(harness.filled(case, harness.SENTINEL))
    tensors: dict[int, dict[str, Any]] = {}
    buffers = []
    for rank, named in plain.items():
        tensors[rank] = {}
        for name, t in named.items():
            tensors[rank][name], buf = _guarded(t)
            buffers.append(buf)
    answer: dict[str, Any] = {"outcome": "ok"}
    try:
        executor.run_all_local(plan_path, tensors)
    except BaseException as e:  # noqa: B036, BLE001 - the parent classifies every outcome
        tb = traceback.extract_tb(e.__traceback__)
        answer = {"outcome": "error", "types": [c.__name__ for c in type(e).__mro__],
                  "message": str(e)[:500],
                  "raised_in": os.path.relpath(tb[-1].filename, ROOT) if tb else "?"}
    answer["guards_ok"] = all(bool((b[:GUARD_BYTES] == GUARD).all()) and
                              bool((b[-GUARD_BYTES:] == GUARD).all()) for b in buffers)
    return answer


def serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.write(json.dumps(_serve_one(req["plan"], req["case"])) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
