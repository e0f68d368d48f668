"""One rank of plans/demo.yaml (or another config) as its own process, driven step by step
by a parent through the rendezvous store (tests/reliability/test_faults.py, bench/long_run.py).

    python -m harness.world_worker --config C --plan P --rank R --port PORT --steps N
        [--start K] [--timeout S] [--die K:MODE] [--check-every M] [--life NAME]

For each step k in K..N the rank waits for the key `go/<k>`, then: sources write the
weights of step k into their tensors in place (deterministic in k), everyone calls
`run()`, targets compare their tensors with step k's bit-exactly (every `--check-every`
steps), and the rank reports `res/<k>/<rank>` (JSON: ok, complete, error, peer, seconds,
rss, fds, register calls). `--die K:post1` (a source) SIGKILLs this process after it posted
its first write batch of step K; `--die K:done1` (a target) after the first DONE of step K
arrived; `--die K:ready` (a target) right after it sent READY in step K; `--die K:stop-MODE`
stops the process (SIGSTOP) at that point instead. The rank sets
`loaded/<rank>/<life>` once connected and exits after `exit`. Tests host the store; this
process never waits more than its timeouts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--die", default="")
    p.add_argument("--check-every", type=int, default=1)
    p.add_argument("--life", default="a")
    p.add_argument("--insecure", action="store_true", help="run without a job secret")
    p.add_argument("--leak", action="store_true",
                   help="test only: publish this rank's plain descriptors at leak/<rank> (an "
                        "attacker who already holds them, tests/support/stray.py)")
    p.add_argument("--bump", action="store_true",
                   help="step k's weights = fixed ones + k %% 97, in place (cheap; long runs)")
    a = p.parse_args()
    if a.insecure:
        os.environ.pop("RDMA_PLAN_SECRET", None)

    import torch
    import torch.distributed as dist

    import executor
    from harness.weights import materialize, random_full_tensors
    from planner.frameworks import build_layout
    from planner.validate import load

    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    cfg, spec = load(a.config)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    is_source = a.rank < src.world
    layout, local = (src, a.rank) if is_source else (dst, a.rank - src.world)
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    tensors = {t.name: torch.zeros(t.shape, dtype=dtypes[t.dtype])
               for t in layout.ranks[local].tensors}

    def weights(k: int) -> dict[str, torch.Tensor]:
        """This rank's tensors at step k (targets: padding stays zero, as nothing writes it)."""
        if a.bump:
            full = {n: t + k % 97 for n, t in weights.full.items()}  # type: ignore[attr-defined]
        else:
            full = random_full_tensors(spec, seed=1000 + k)
        return materialize(layout, full, ranks=[local])[local]

    if a.bump:  # small integers: base + k % 97 stays exact in bf16
        gen = torch.Generator().manual_seed(7)
        weights.full = {n: torch.randint(-64, 64, t.shape, generator=gen).to(t.dtype)  # type: ignore[attr-defined]
                        for n, t in random_full_tensors(spec, seed=7).items()}
        weights.base = weights(0)  # type: ignore[attr-defined]

    try:
        plan = executor.load(a.plan, a.rank, tensors, transport="nixl", rendezvous=store,
                             timeout_s=30, insecure=a.insecure,
                             no_identity=True)  # the harness numbers the ranks
    except (executor.PeerMismatchError, executor.PeerTimeoutError, executor.BindError,
            executor.LeaseHeldError, executor.ForgedRecordError) as e:
        store.set(f"loaded/{a.rank}/{a.life}", json.dumps(
            {"error": type(e).__name__, "peer": getattr(e, "peer", None), "msg": str(e)}))
        store.wait(["exit"], timedelta(seconds=120))  # stay reachable for the others
        return 4
    plan.timeout_s = a.timeout  # loading may wait for slow peers; steps may not
    if a.leak:
        import msgpack
        store.set(f"leak/{a.rank}", msgpack.packb({"desc": plan.transport.export(),
                                                   "inc": plan.incarnation,
                                                   "name": plan.transport.name}))
    die_step, _, mode = a.die.partition(":")
    if die_step:
        _arm(plan, int(die_step), mode)
    store.set(f"loaded/{a.rank}/{a.life}", json.dumps(
        {"step": plan.step, "rss": rss_bytes(), "fds": open_fds(),
         "registers": plan.register_calls}))
    for k in range(a.start, a.steps + 1):
        if not _wait_go(store, k):
            break  # the test ended before step k
        plan.test_step = k  # type: ignore[attr-defined]
        if is_source:
            if a.bump:  # the "training step": weights change in place
                for n, t in tensors.items():
                    t.copy_(weights.base[n]).add_(k % 97)  # type: ignore[attr-defined]
            else:
                for n, t in weights(k).items():
                    tensors[n].copy_(t)
        t0 = time.monotonic()
        res: dict = {"step": k}
        try:
            stats = plan.run()
            res.update(ok=True, run_s=stats.seconds)
        except (executor.PeerTimeoutError, executor.LeaseLostError) as e:
            res.update(ok=False, error=type(e).__name__, peer=getattr(e, "peer", None),
                       msg=str(e))
        res.update(complete=plan.complete, seconds=time.monotonic() - t0, rss=rss_bytes(),
                   fds=open_fds(), registers=plan.register_calls,
                   reimports=plan.recovery.reimports, reprepared=plan.recovery.reprepared,
                   leaked=plan.transport.stats().get("leaked", 0),
                   exec_step=plan.step, refused=plan.inbox.refused,
                   last_refused=plan.inbox.last_refused, refused_records=plan.control.refused,
                   republished=plan.control.republished)
        if res["ok"] and not is_source and (k % a.check_every == 0 or k == a.steps):
            want = weights(k)
            bad = [n for n, t in tensors.items() if not torch.equal(t, want[n])]
            res.update(exact=not bad, mismatch=bad[:3])
        store.set(f"res/{k}/{a.rank}", json.dumps(res))
    store.wait(["exit"], timedelta(seconds=120))
    plan.close()
    return 0


def _wait_go(store, k: int) -> bool:
    """Wait for `go/<k>` (True) or `exit` (False), at most 120 s."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if store.check([f"go/{k}"]):
            return True
        if store.check(["exit"]):
            return False
        time.sleep(0.005)
    return False


def _arm(plan, step: int, mode: str) -> None:
    """Test-only: SIGKILL (or with `stop-`, SIGSTOP) this process at a chosen point of test
    step `step`."""
    tr = plan.transport
    sig = signal.SIGKILL
    if mode.startswith("stop-"):
        sig, mode = signal.SIGSTOP, mode[5:]
    if mode == "post1":
        post = tr.post

        def dying_post(handle):
            post(handle)
            if getattr(plan, "test_step", 0) == step:
                time.sleep(0.002)  # let the first batch get on the wire
                os.kill(os.getpid(), sig)
        tr.post = dying_post
    elif mode == "ready":  # a target: right after it sent READY, before any write landed
        poll = tr.poll

        def dying_poll_ready():
            if getattr(plan, "test_step", 0) == step:
                os.kill(os.getpid(), sig)
            return poll()
        tr.poll = dying_poll_ready
    elif mode == "done1":
        poll = tr.poll

        def dying_poll():
            msgs = poll()
            if msgs and getattr(plan, "test_step", 0) == step:
                os.kill(os.getpid(), sig)
            return msgs
        tr.poll = dying_poll
    else:
        raise SystemExit(f"--die mode {mode!r}: use post1, ready or done1")


if __name__ == "__main__":
    sys.exit(main())
