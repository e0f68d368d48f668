"""The plan fuzz (`fuzz.py`): thousands of mutants of plans with PACK, QUANT, gathers and
several stages, each run in a guarded child process.

Every mutant must be refused (a `UserError`), or run correctly, or run with wrong data only
in the consistent case (every rank holds the same tampered plan, no key given) and only of
a class no per-rank load check can see (`WHOLE_PLAN`): a valid plan of another transfer
(`verify` accepts it), or one that only `verify`'s whole-plan checks reject (coverage,
signal pairing, dataflow across ranks: `docs/reliability.md` says why the executor does not
run them). A wrong result of a plan that a per-rank check rejects is a failure. Always:
no byte written outside the regions (guards intact, source tensors unchanged), no
traceback (the executor, `inspect`, `verify`, `simulate`: only `UserError`s), no hang (a
bounded time per mutant),
`plan_key` refuses every mutant, and where one rank holds the mutant and the others the
base plan, the ranks refuse each other or the data is right.

Profiles: 150 mutants in the README's test command; 600 others (the next seed) in the deep
profile (`pytest -m deep`, which `.ci/run` runs after it); `RPLAN_FUZZ_MUTANTS` (default
3000) in the opt-in profile (`pytest -m extended`), with `RPLAN_FUZZ_SEED` (default 0); e.g.
`RPLAN_FUZZ_MUTANTS=20000 RPLAN_FUZZ_SEED=7 pytest tests/property/test_plan_fuzz.py` for a
deeper run. The summary is printed (`-s` shows it).
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time

import pytest

from schemas.plan import load_plan
from tests.property import fuzz
from tests.support.clock import guard_s, no_answer

MUTANTS = int(os.environ.get("RPLAN_FUZZ_MUTANTS", "3000"))
QUICK = min(MUTANTS, 150)
DEEP = min(MUTANTS, 600)
"""The deep profile's size: every kind of mutant (raw bytes, ops, msgpack fields) a hundred
times or more, a fifth of the opt-in run's."""
SEED = int(os.environ.get("RPLAN_FUZZ_SEED", "0"))
JOBS = int(os.environ.get("RPLAN_FUZZ_JOBS", "2"))
TIMEOUT_S = guard_s(12.0)
"""A mutant's answer (executor, inspect, verify, simulate; each well under a second on a
quiet box, the slowest a few seconds): none within this is a hang."""
FIRST_TIMEOUT_S = guard_s(60.0)
"""A worker's first answer includes its set-up (imports, the base plans)."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Child:
    """One worker process (`python -m tests.property.fuzz`) and the request it is on. One
    torch thread each: `JOBS` workers share the cores, and a mutant's tensors are small
    (two threads a worker spun on each other's ops: 2.5x the CPU seconds on a 2-core box)."""

    def __init__(self, folder: str, i: int) -> None:
        self.path = os.path.join(folder, f"mutant{i}.rplan")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.property.fuzz"], cwd=ROOT, text=True,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.job: tuple | None = None
        self.since = 0.0

    def send(self, base: str, data: bytes, job: tuple, timeout_s: float) -> None:
        with open(self.path, "wb") as f:
            f.write(data)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"base": base, "plan": self.path}) + "\n")
        self.proc.stdin.flush()
        self.job, self.since, self.timeout_s = job, time.monotonic(), timeout_s

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _run(jobs: list[tuple], bases: dict[str, str], folder: str
         ) -> list[tuple[tuple, dict]]:
    """Every job (name, kind, what, data, same) answered by `JOBS` workers in parallel; a
    worker that does not answer within `TIMEOUT_S` (its first request: the base plans'
    set-up, `FIRST_TIMEOUT_S`) is a hang, and is replaced."""
    todo, out = list(reversed(jobs)), []
    children = [_Child(folder, i) for i in range(JOBS)]
    first = set(range(JOBS))
    try:
        while todo or any(c.job for c in children):
            for i, c in enumerate(children):
                if c.job is None and todo:
                    job = todo.pop()
                    c.send(bases[job[0]], job[3], job,
                           FIRST_TIMEOUT_S if i in first else TIMEOUT_S)
                    first.discard(i)
            busy = {c.proc.stdout: c for c in children if c.job is not None}
            ready, _, _ = select.select(list(busy), [], [], 0.5)
            for stream in ready:
                c = busy[stream]
                line = stream.readline()
                out.append((c.job, json.loads(line) if line else
                            {"hang_or_crash": "the worker died"}))
                c.job = None
            now = time.monotonic()
            for i, c in enumerate(children):
                dead = c.job is not None and c.proc.poll() is not None
                if c.job is not None and (now - c.since > c.timeout_s or dead):
                    if c.proc.stdout in ready:
                        continue
                    out.append((c.job, {"hang_or_crash": no_answer("the worker", c.timeout_s)}))
                    c.stop()
                    children[i] = _Child(folder, i)
                    first.add(i)
    finally:
        for c in children:
            c.stop()
    return out


WHOLE_PLAN = {
    "coverage": ("bytes written per run", "writes overlap", "coverage names"),
    "order": ("which is never sent", "which nobody waits for", "the stage DAG has a cycle",
              "may still read"),
    "dataflow": ("no pack of its stage fills", "no write of its stage fills",
                 "packs of stage", "packs early"),
    "staging_fit": ("exceeds what its ops use at peak",),
    "balance": ("more than the mean",),
}
"""verify's checks that need every rank's blob, by the words of their messages."""


def wrong_class(violation: str | None) -> str | None:
    """The class of a consistent tamper that ran with wrong data: `valid plan` (verify
    accepts it), a whole-plan check's name, or None (a per-rank check rejects it: the
    executor should have refused it at load)."""
    if violation is None:
        return "valid plan of another transfer"
    return next((name for name, words in WHOLE_PLAN.items()
                 if any(w in violation for w in words)), None)


def _problems(ans: dict, same_as_base: bool) -> list[str]:
    if "hang_or_crash" in ans:
        return [f"hang or crash: {ans['hang_or_crash']}"]
    out = []
    for name in ("keyed", "run", "inspect", "verify", "simulate"):
        o = ans[name]
        if not o["ok"] and not o["user"]:
            out.append(f"{name}: traceback {o['type']} at {o['where']}: {o['msg']}")
    if ans["keyed"]["ok"] and not same_as_base:
        out.append("plan_key accepted a mutant")
    if not ans["guards_ok"]:
        out.append("wrote outside its tensors (guard bytes changed)")
    if not ans["sources_ok"]:
        out.append("wrote into a source tensor")
    m = ans["mixed"]
    if m is not None:
        if not m["ok"] and not m["user"]:
            out.append(f"mixed run: traceback {m['type']} at {m['where']}: {m['msg']}")
        if m["ok"] and not m["correct"]:
            out.append(f"mixed run (rank {m['rank']} holds the mutant) gave wrong data")
        if not m["guards_ok"]:
            out.append("mixed run wrote outside its tensors")
    return out


@pytest.mark.parametrize("mutants, seed", [
    pytest.param(QUICK, SEED, id=str(QUICK)),
    pytest.param(DEEP, SEED + 1, marks=pytest.mark.extended, id="deep"),
    pytest.param(MUTANTS, SEED, marks=pytest.mark.extended, id="full")])
def test_plan_fuzz(mutants: int, seed: int) -> None:
    """`QUICK` mutants in the README's test command; `DEEP` others (the next seed) in the
    deep profile (`pytest -m deep`, run by `.ci/run`); `MUTANTS` in the opt-in profile."""
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        bases = fuzz.base_plans(tmp)
        raw = {n: open(p, "rb").read() for n, p in bases.items()}
        plans = {n: load_plan(p) for n, p in bases.items()}
        jobs = []
        for _ in range(mutants):
            name = rng.choice(sorted(bases))
            kind, what, data = fuzz.mutant(rng, raw[name], plans[name])
            jobs.append((name, kind, what, data, data == raw[name]))
        answers = _run(jobs, bases, tmp)
    for (name, kind, what, _, same), ans in answers:
        bad = _problems(ans, same)
        counts[kind] += 1
        if bad:
            failures.append(f"{name} {kind} {what}: {'; '.join(bad)}")
            continue
        if ans["run"]["ok"] and not ans["correct"]:
            why = wrong_class(ans.get("violation"))
            if why is None:
                failures.append(f"{name} {kind} {what}: ran with wrong data although a "
                                f"per-rank check rejects it: {ans['violation']}")
                continue
            counts[f"wrong: {why}"] += 1
        counts["refused" if not ans["run"]["ok"] else
               "correct" if ans["correct"] else "wrong (consistent tamper)"] += 1
        counts["unchanged"] += same
        if ans["mixed"] is not None:
            counts["mixed refused" if not ans["mixed"]["ok"] else "mixed correct"] += 1
    seconds = time.monotonic() - t0
    print(f"\nplan fuzz: {len(answers)} mutants (seed {seed}, {JOBS} workers) in {seconds:.0f} "
          f"s: {dict(counts)}; {len(failures)} failures")
    assert len(answers) == mutants
    assert not failures, "\n".join(failures[:20])


def test_the_fuzz_sees_a_write_outside_its_region(monkeypatch, tmp_path) -> None:
    """The guards can fail: with the bounds proof switched off, a write 64 bytes past the
    end of its target region (into the guard bytes after it) is reported."""
    import dataclasses

    import numpy as np

    import executor.check
    from schemas.plan import Table
    from schemas.plan_write import write_plan

    bases = fuzz.base_plans(str(tmp_path))
    plan = load_plan(bases["cast"])
    rp = plan.ranks[0]
    w = {n: np.array(rp.writes[n]) for n, _ in rp.writes.schema}
    peer, region = int(w["dst_rank"][0]), int(w["dst_region"][0])
    w["dst_offset"][0] = plan.ranks[peer].regions[region].nbytes - int(w["nbytes"][0]) + 64
    bad = dataclasses.replace(plan, ranks=(dataclasses.replace(
        rp, writes=Table.build(rp.writes.schema, **w)), *plan.ranks[1:]))
    path = str(tmp_path / "bad.rplan")
    write_plan(path, bad)
    monkeypatch.setattr(executor.check, "violations", lambda *a, **k: iter(()))
    ans = fuzz.Worker().serve_one(bases["cast"], path)
    assert ans["run"]["ok"] and not ans["guards_ok"]
    assert any("outside its tensors" in p for p in _problems(ans, False))
