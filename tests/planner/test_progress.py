"""The compile progress reporter: silent for quick compiles off a terminal, one line per
pass after `delay` seconds, a rewritten line on a terminal (fake clock, no sleeping)."""

from __future__ import annotations

import io

from planner.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_quick_compile_off_a_terminal_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with Progress("compile", stream=out, tty=False, clock=clock) as p:
        for step, t in (("layouts", 0.1), ("intersect", 0.5), ("emit", 1.9)):
            clock.t = t
            p(step)
    assert out.getvalue() == ""


def test_slow_compile_off_a_terminal_prints_a_line_per_pass_after_the_delay():
    out, clock = io.StringIO(), Clock()
    with Progress("compile", stream=out, tty=False, clock=clock) as p:
        for step, t in (("layouts", 0.1), ("intersect", 2.5), ("lower", 7.25)):
            clock.t = t
            p(step)
        clock.t = 9.0
    assert out.getvalue().splitlines() == [
        "compile: intersect (at 2.5 s)", "compile: lower (at 7.2 s)", "compile: done in 9.0 s"]


def test_terminal_line_is_rewritten_and_erased_after_a_quick_compile():
    out, clock = io.StringIO(), Clock()
    p = Progress("compile", stream=out, tty=True, clock=clock)
    clock.t = 0.2
    p("layouts")
    clock.t = 0.4
    p("emit")
    clock.t = 0.5
    p.close()
    text = out.getvalue()
    assert "\rcompile: layouts  0.2 s" in text and "\rcompile: emit  0.4 s" in text
    assert "\n" not in text and text.endswith("\r")  # erased, nothing left behind


def test_terminal_line_after_a_slow_compile_ends_with_done():
    out, clock = io.StringIO(), Clock()
    p = Progress("compile", stream=out, tty=True, clock=clock)
    p("layouts")
    clock.t = 12.0
    p.close()
    assert out.getvalue().rstrip().endswith("compile: done in 12.0 s")


def test_a_long_pass_off_a_terminal_prints_a_line_every_heartbeat():
    out, clock = io.StringIO(), Clock()
    p = Progress("compile", stream=out, tty=False, clock=clock, heartbeat=10.0)
    p("layouts")
    clock.t = 2.5
    p("lower")
    for t in (5.0, 12.4, 12.6, 20.0, 23.0):  # the ticker's calls, at these times
        clock.t = t
        p.beat()
    clock.t = 24.0
    p.close()
    assert out.getvalue().splitlines() == [
        "compile: lower (at 2.5 s)", "compile: still lower (at 12.6 s)",
        "compile: still lower (at 23.0 s)", "compile: done in 24.0 s"]


def test_a_quick_pass_prints_no_heartbeat():
    out, clock = io.StringIO(), Clock()
    p = Progress("compile", stream=out, tty=False, clock=clock, heartbeat=10.0)
    p("layouts")
    clock.t = 1.5
    p.beat()  # before the delay: nothing
    p.close()
    assert out.getvalue() == ""
