"""A small progress reporter for long compiles: pass name and elapsed seconds on stderr.

    with Progress("compile") as progress:
        compile_config(cfg, spec, progress=progress)

On a terminal, one line is rewritten in place (`compile: lower  12.3 s`) and ticks every
half second; it is erased at the end of a compile that took under `delay` seconds.
Elsewhere (logs, CI), nothing is printed until `delay` seconds have passed, then one line
per pass, and a line every `heartbeat` seconds while one pass runs on (`compile: still
lower (at 40.0 s)`): a long compile is never silent. No dependency.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """A `progress(step)` callback for `planner.compiler.compile_config`."""

    def __init__(self, what: str = "compile", stream: TextIO | None = None,
                 delay: float = 2.0, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 heartbeat: float = 10.0) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty",
                                                            lambda: False)())
        self.clock = clock
        self.t0 = clock()
        self.step = "start"
        self.heartbeat = heartbeat
        self.last_line = self.t0
        """When the last line was printed off a terminal (the heartbeat's clock)."""
        self.shown = False
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def __call__(self, step: str) -> None:
        with self._lock:
            self.step = step
            if self.tty:
                self._line()
            elif self.elapsed() >= self.delay:
                self._print(f"{self.what}: {step} (at {self.elapsed():.1f} s)\n")
                self.last_line = self.clock()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5 if self.tty else 1.0):
            with self._lock:
                if self.tty:
                    self._line()
                else:
                    self.beat()

    def beat(self) -> None:
        """Off a terminal: one line when a pass has run `heartbeat` seconds since the last
        line (past the `delay`)."""
        now = self.clock()
        if now - self.t0 >= self.delay and now - self.last_line >= self.heartbeat:
            self._print(f"{self.what}: still {self.step} (at {now - self.t0:.1f} s)\n")
            self.last_line = now

    def _line(self) -> None:
        text = f"{self.what}: {self.step}  {self.elapsed():.1f} s"
        pad = " " * max(0, self._width - len(text))
        self._width = len(text)
        self._print(f"\r{text}{pad}")

    def _print(self, text: str) -> None:
        self.shown = True
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        """Stop ticking; finish the line (or erase it after a quick compile)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if not self.shown:
                return
            if self.tty and self.elapsed() < self.delay:
                self._print("\r" + " " * self._width + "\r")
            elif self.tty:
                self._print(f"\r{self.what}: done in {self.elapsed():.1f} s"
                            f"{' ' * max(0, self._width - 20)}\n")
            else:
                self._print(f"{self.what}: done in {self.elapsed():.1f} s\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
