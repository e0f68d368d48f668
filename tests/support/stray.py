"""A hostile process on the job's network, without the job secret (`tests/support/strays.py`
runs it for tests/reliability/test_attacks.py and test_replay.py).

    python stray.py --port PORT --plan PLAN MODE [options]

Modes:
- `forge --target T --claim C --step K [--secret S]`: send the target every signal kind of
  every stage of step K as if from rank C, through its own NIXL agent. It uses descriptors
  the test leaked to it (`leak/<rank>`, what an attacker holding them would have). Without
  `--secret` it signs with a key of its own (a forgery); with the job's secret the MAC is
  right and only the sender check (its agent is not rank C's) stands in the way.
- `records --ranks R,...`: overwrite those ranks' descriptor records with its own agent's
  descriptors (sealed under a key of its own: a hijack attempt), and move rank 1's record to
  rank 0's key.
- `garbage`: random bytes, an oversized step and a truncated record into the store.
- `replay --ranks R,... --capture S`: read those ranks' lease records for S seconds (every
  value they take: sealed with the secret, so valid), then write them back, cycling through
  them every 30 ms, until the test says stop (a replay: no secret needed).

Prints one JSON line of what it did. Never waits more than a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["forge", "records", "garbage", "replay"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--target", default="2", help="ranks, comma-separated")
    p.add_argument("--claim", default="0", help="ranks, comma-separated")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--secret", default="")
    p.add_argument("--ranks", default="0")
    p.add_argument("--capture", type=float, default=2.0)
    p.add_argument("--spoof", action="store_true",
                   help="forge: one agent per claimed rank, named like that rank's agent")
    a = p.parse_args()

    import msgpack
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    if a.mode == "garbage":
        return _garbage(store)
    if a.mode == "replay":
        return _replay(store, [int(r) for r in a.ranks.split(",")], a.capture)
    from nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"stray-{os.getpid()}", nixl_agent_config(enable_prog_thread=False,
                                                                backends=["UCX"]))
    if a.mode == "records":
        return _records(store, agent, [int(r) for r in a.ranks.split(",")])
    from executor import signals
    from executor.auth import keys_from
    from schemas.plan import ACK, DONE, READY, load_plan

    plan = load_plan(a.plan)
    tag = signals.fingerprint_tag(plan.header.fingerprint)
    keys = keys_from(a.secret or os.urandom(32).hex())
    claims = [(c, msgpack.unpackb(store.get(f"leak/{c}"))) for c in map(int, a.claim.split(","))]
    agents = {c: nixl_agent(leak["name"], nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"])) if a.spoof else agent
        for c, leak in claims}
    targets = []
    for target in map(int, a.target.split(",")):
        leak = msgpack.unpackb(store.get(f"leak/{target}"))
        names = {c: ag.add_remote_agent(leak["desc"]["agent"]) for c, ag in agents.items()}
        targets.append((names, leak["inc"]))
    claims = [(c, leak["inc"]) for c, leak in claims]
    sent, rounds = 0, 0
    end = time.monotonic() + 30
    # the sends complete only once a target progresses UCX (when it polls, in a step): send
    # the lot again every 20 ms, for the steps to come too, until the test says stop
    while time.monotonic() < end and not store.check(["stray/stop"]):
        for names, inc in targets:
            for claim, claim_inc in claims:
                ag, name = agents[claim], names[claim]
                for step in range(a.step, a.step + 3):
                    for stage in range(plan.header.stages):
                        for kind in (READY, DONE, ACK):
                            sent += 1
                            ag.send_notif(name, signals.encode(
                                keys, tag, claim_inc, inc, step, stage, kind, claim,
                                10**6 + sent))
        if rounds == 0:
            print(json.dumps({"sent": sent}), flush=True)
        rounds += 1
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            for ag in {id(x): x for x in agents.values()}.values():
                ag.get_new_notifs()
            time.sleep(0.002)
    return 0


def _records(store, agent, ranks: list[int]) -> int:
    from executor.auth import keys_from, seal

    mine = keys_from(os.urandom(32).hex())  # not the job's secret
    for r in ranks:
        key = f"rplan/rank/{r}"
        info = {"fingerprint": "", "sizes": [], "desc": {
            "agent": agent.get_agent_metadata(), "addrs": [], "dev": 0}}
        store.set(key, seal(mine, key, r, 2**63, 99, 0, info))
    store.set("rplan/rank/0", store.get("rplan/rank/1"))  # a real record, moved
    print(json.dumps({"forged": ranks, "moved": "rplan/rank/1 -> rplan/rank/0"}), flush=True)
    return 0


def _replay(store, ranks: list[int], capture_s: float) -> int:
    seen: dict[int, list[bytes]] = {r: [] for r in ranks}
    end = time.monotonic() + capture_s
    while time.monotonic() < end:
        for r in ranks:
            if store.check([f"rplan/lease/{r}"]):
                v = store.get(f"rplan/lease/{r}")
                if v not in seen[r]:
                    seen[r].append(v)
        time.sleep(0.01)
    print(json.dumps({"captured": {r: len(v) for r, v in seen.items()}}), flush=True)
    i, end = 0, time.monotonic() + 120
    while time.monotonic() < end and not store.check(["stray/stop"]):
        for r, values in seen.items():
            if values:
                store.set(f"rplan/lease/{r}", values[i % len(values)])
        i += 1
        time.sleep(0.03)
    return 0


def _garbage(store) -> int:
    import msgpack

    writes = {"rplan/rank/1": os.urandom(300), "rplan/step/3": b"99999999999999999999",
              "rplan/lease/2": os.urandom(64), "rplan/step/0": msgpack.packb({"v": 1})[:-1],
              "rplan/rank/3": msgpack.packb([2**64 - 1] * 10)}
    for k, v in writes.items():
        store.set(k, v)
    print(json.dumps({"garbage": sorted(writes)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
