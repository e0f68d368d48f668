"""Long run: many `run()` steps of plans/demo.yaml over NIXL between 4 processes.

    python3 bench/long_run.py [--steps 1000] [--check-every 100] [--tls tcp]
    python3 bench/long_run.py --tiny      # 3 steps, checked every step (the test suite's)

Sources change their weights in place every step (fixed small integers + step % 97, so
every value is exact in bf16); targets compare all their tensors bit-exactly with the
expected ones every `--check-every` steps and at the last step. Every rank reports its
RSS, open file descriptors and transport registrations after loading, at every check and
at the end; the run fails if any check differs, any step raises, a rank registered more
than once, or the descriptors grew. Prints a table and one JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def long_run(steps: int = 1000, check_every: int = 100, tls: str | None = None,
             config: str | None = None, timeout_s: float = 10.0) -> dict:
    from harness.world import World
    from planner.compiler import compile_file

    config = config or os.path.join(ROOT, "plans", "demo.yaml")
    out = tempfile.mkdtemp(prefix="rdma-plan-long-")
    plan = os.path.join(out, "demo.rplan")
    compile_file(config, plan)
    w = World(config, plan, 4, steps=steps, timeout_s=timeout_s, tls=tls,
              extra=("--bump", "--check-every", str(check_every)))
    ranks = list(range(4))
    samples: list[dict] = []
    try:
        for r in ranks:
            w.spawn(r)
        loaded = {r: w.loaded(r, timeout_s=120) for r in ranks}
        samples.append({"step": 0, **{str(r): _mem(loaded[r]) for r in ranks}})
        failures, exact_checks, run_s = [], 0, []
        t0 = time.perf_counter()
        for k in range(1, steps + 1):
            res = w.step(k, ranks, timeout_s=timeout_s + 30)
            failures += [(k, r, x.get("msg")) for r, x in res.items() if not x["ok"]]
            failures += [(k, r, x["mismatch"]) for r, x in res.items() if x.get("exact") is False]
            exact_checks += sum(1 for x in res.values() if x.get("exact") is True)
            run_s += [x.get("run_s", 0.0) for x in res.values()]
            if k % check_every == 0 or k == steps or k == 1:
                samples.append({"step": k, **{str(r): _mem(res[r]) for r in ranks}})
            if failures:
                break
        wall = time.perf_counter() - t0
    finally:
        w.close()
    # growth is counted from the first step on: what it opens lazily (a transport's
    # connection to each peer, UCX's endpoints) is set-up, not a leak
    first, last = samples[min(1, len(samples) - 1)], samples[-1]
    run_s.sort()
    return {"steps": steps, "steps_done": last["step"], "failures": failures[:5],
            "exact_checks": exact_checks, "wall_s": round(wall, 2),
            "run_ms_median": round(1e3 * run_s[len(run_s) // 2], 3) if run_s else None,
            "run_ms_p99": round(1e3 * run_s[int(len(run_s) * 0.99)], 3) if run_s else None,
            "registers": {r: last[str(r)]["registers"] for r in ranks},
            "rss_mb_growth": {r: round(last[str(r)]["rss_mb"] - first[str(r)]["rss_mb"], 2)
                              for r in ranks},
            "fds_growth": {r: last[str(r)]["fds"] - first[str(r)]["fds"] for r in ranks},
            "samples": samples, "tls": tls or "default"}


def _mem(x: dict) -> dict:
    return {"rss_mb": round(x["rss"] / 2**20, 2), "fds": x["fds"], "registers": x["registers"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--tls", default=None, help="UCX_TLS for the ranks (default: UCX's own)")
    p.add_argument("--config", default=None)
    p.add_argument("--tiny", action="store_true", help="3 steps, checked every step")
    a = p.parse_args()
    if a.tiny:
        a.steps, a.check_every = 3, 1
    rep = long_run(a.steps, a.check_every, a.tls, a.config)
    print(f"{'step':>6} " + " ".join(f"{'rank ' + str(r) + ' RSS MB / fds':>22}" for r in range(4)))
    for s in rep["samples"]:
        print(f"{s['step']:>6} " + " ".join(f"{s[str(r)]['rss_mb']:>15.1f} / {s[str(r)]['fds']:>3}"
                                           for r in range(4)))
    ok = (not rep["failures"] and rep["steps_done"] == a.steps
          and all(v == 1 for v in rep["registers"].values())
          and all(v <= 0 for v in rep["fds_growth"].values()))
    print(f"{rep['steps_done']}/{a.steps} steps in {rep['wall_s']} s (UCX_TLS "
          f"{rep['tls']}), run() median {rep['run_ms_median']} ms, p99 {rep['run_ms_p99']} ms; "
          f"{rep['exact_checks']} bit-exact target checks; registrations per rank "
          f"{rep['registers']}; RSS growth MB {rep['rss_mb_growth']}; fd growth "
          f"{rep['fds_growth']}; failures {rep['failures']}: {'OK' if ok else 'FAILED'}")
    print(json.dumps(rep))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
