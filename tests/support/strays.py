"""A fault drill with hostile processes: `StrayWorld` is `harness.world.World` plus
`stray.py` runs, processes on the job's network without the job secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from harness.world import World

STRAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stray.py")


class StrayWorld(World):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strays: list[subprocess.Popen] = []

    def stray(self, mode: str, *args: str) -> dict:
        """Run `stray.py` (a hostile process without the job secret) until it has done its
        deed; a `forge` stray stays (progressing its sends) until `strays_stop`."""
        env = {k: v for k, v in self.env.items() if k != "RDMA_PLAN_SECRET"}
        self.store.delete_key("stray/stop")
        proc = subprocess.Popen([sys.executable, STRAY, mode, "--port", str(self.port),
                                 "--plan", self.plan, *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        self.strays.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("{"), f"stray {mode} failed (exit {proc.wait(timeout=30)})"
        return json.loads(line)

    def strays_stop(self) -> None:
        self.store.set("stray/stop", b"1")
        for proc in self.strays:
            proc.wait(timeout=30)
        self.strays = []

    def close(self) -> None:
        self.strays_stop()
        super().close()
