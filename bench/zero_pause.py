"""Zero-pause refit on a stand-in engine: a decode loop reading the target tensors.

    python bench/zero_pause.py [--models 2048x8,4096x16] [--sources 2] [--targets 2]
                               [--steps 5] [--device cuda]
    python bench/zero_pause.py --tiny     # CPU, float32, seconds

One process, the `local` transport (every rank in this process, one device). A model
`DxK` is K weights [D, D] per target rank (bf16 on a GPU), sent whole by the sources
(tensor i from source i % S). Each target rank is an "engine": its decode step is K matmuls
of a [B, D] activation through its live weights. Per model, in one run:

- `decode` undisturbed: median step time with no transfer;
- `during`: median step time while the shadow transfer runs (the engine keeps decoding;
  `steps during` is how many it finished meanwhile), and the transfer's seconds;
- `pause`: the switch (shadow -> live copies, every data_ptr kept), the largest over the
  target ranks, beside its floor (a target rank's bytes over this device's measured local
  copy bandwidth: one `copy_` of that many bytes);
- `paused refit`: the same plan run into the live tensors with the engine stopped (the
  engine pauses for the whole transfer).

`--chunked C`: a second table, the same models through a chunked shadow of C chunks
(`executor/chunked.py`): the whole refit (the pause of an engine kept paused across it) and
the largest switch of one chunk (the pause per chunk of an engine that accepts serving
layers at N+1 beside layers at N), beside the full shadow's pause and the paused refit.

`--slow-source-ms X` starts the sources X ms late in each shadow step: the transfer grows
by X, the engine decodes through it, and the pause must stay what the switch costs.

Bit-exact after each switch (the live tensors equal the sources' bytes) or it exits 1.
Ranks wait without spinning here unless RDMA_PLAN_SPIN_S is set (see the import block).
All ranks share one device and one stream here: the sources' writes are local copies
that compete with the decode for memory bandwidth, which a NIC or NVLink write does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every rank is a thread of this one process here: a wait's first 2 ms of spinning
# (executor/spin.py) holds the GIL the other ranks and the decode need, which processes of
# their own do not share (on one H200 it made the paused refit 3.7x slower, 10.4 ms -> 2.85
# ms, and a chunked shadow's chunk's switch ~5 ms). So ranks nap from the start, unless the caller
# sets RDMA_PLAN_SPIN_S. (Run as a script only: an importer keeps its own.)
if __name__ == "__main__":
    os.environ.setdefault("RDMA_PLAN_SPIN_S", "0")

from bench.zero_pause_plan import SIZE, make_plan  # noqa: E402
from executor import Executor, Shadow  # noqa: E402
from executor.transports.local import Fabric  # noqa: E402
from schemas.plan import load_plan  # noqa: E402


class World:
    """Executors of every rank over one `Fabric`; targets bound to `bind[t]`."""

    def __init__(self, path: str, src: dict[int, dict[str, torch.Tensor]],
                 bind: dict[int, dict[str, torch.Tensor]]) -> None:
        plan = load_plan(path)
        fabric = Fabric()
        self.exs = {rp.rank: Executor(plan.header, rp, src.get(rp.rank) or bind[rp.rank],
                                      transport="local", rendezvous=fabric, step_records=False,
                                      timeout_s=TIMEOUT_S)
                    for rp in plan.ranks}
        for ex in self.exs.values():
            ex.register()
        for ex in self.exs.values():
            ex.connect()

    def run(self, ranks: list[int], step: int, delay_s: float = 0.0
            ) -> list[threading.Thread]:
        """Each rank's step on a thread of its own, after `delay_s` (a slow source)."""
        def go(r: int) -> None:
            time.sleep(delay_s)
            self.exs[r].run(step)
        threads = [threading.Thread(target=_guarded(go, f"rank {r} step {step}"), args=(r,),
                                    daemon=True) for r in ranks]
        for th in threads:
            th.start()
        return threads

    def close(self) -> None:
        for ex in self.exs.values():
            ex.close()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(xs: dict[int, torch.Tensor], live: dict[int, dict[str, torch.Tensor]],
           device: torch.device) -> float:
    """One decode step of every target rank; its seconds."""
    t0 = time.perf_counter()
    for t, x in xs.items():
        for w in live[t].values():
            x = torch.tanh(x @ w)
        xs[t] = x
    sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes per second of one local `copy_` of `nbytes` (median of 5)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def bench_model(d: int, k: int, args: argparse.Namespace, device: torch.device) -> dict:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    tdt = getattr(torch, dtype)
    S, T = args.sources, args.targets
    tgts = list(range(S, S + T))
    path = os.path.join(tempfile.mkdtemp(prefix="zero-pause-"), "p.rplan")
    make_plan(path, d, k, S, T, dtype)
    plan = load_plan(path)
    src = {rp.rank: {r.name: torch.zeros(d, d, dtype=tdt, device=device)
                     for r in rp.regions} for rp in plan.ranks if rp.role == "source"}
    scale = d ** -0.5

    def fill(step: int) -> None:
        g = torch.Generator(device=device).manual_seed(step)
        for named in src.values():
            for t in named.values():
                t.copy_(torch.randn(d, d, generator=g, device=device, dtype=torch.float32)
                        .mul_(scale))

    def want(t: int, i: int) -> torch.Tensor:
        return src[i % S][f"t{t}.w{i}"]

    live = {t: {f"w{i}": torch.zeros(d, d, dtype=tdt, device=device) for i in range(k)}
            for t in tgts}
    ptrs = {(t, n): x.data_ptr() for t in tgts for n, x in live[t].items()}
    shadows = {t: Shadow(live[t]) for t in tgts}
    shadowed = World(path, src, {t: shadows[t].tensors for t in tgts})
    for t in tgts:
        shadows[t].attach(shadowed.exs[t])
    xs = {t: torch.randn(args.batch, d, dtype=tdt, device=device) for t in tgts}
    rows: dict[str, list[float]] = {"undisturbed": [], "during": [], "transfer": [],
                                    "pause": [], "paused": [], "n_during": []}
    for step in range(1, args.steps + 2):  # step 1 warms up
        fill(step)
        sync(device)
        rows["undisturbed"] += [decode(xs, live, device) for _ in range(3)]
        t0 = time.perf_counter()
        for t in tgts:
            shadows[t].start(step)
        threads = shadowed.run(list(range(S)), step, args.slow_source_ms / 1e3)
        during = []
        while any(th.is_alive() for th in threads) or any(
                s._thread is not None and s._thread.is_alive() for s in shadows.values()):
            during.append(decode(xs, live, device))
        for t in tgts:
            shadows[t].finish(TIMEOUT_S)
        _join(threads, start=False)
        transfer = time.perf_counter() - t0
        pause = max(shadows[t].switch() for t in tgts)
        bad = [f"t{t}.w{i}" for t in tgts for i in range(k)
               if not torch.equal(live[t][f"w{i}"], want(t, i))]
        moved = [n for n, p in ptrs.items() if live[n[0]][n[1]].data_ptr() != p]
        if bad or moved:
            sys.exit(f"zero_pause {d}x{k} step {step}: not bit-exact after the switch "
                     f"({bad[:3]}) or moved ({moved[:3]})")
        if step > 1:
            rows["during"] += during
            rows["n_during"].append(len(during))
            rows["transfer"].append(transfer)
            rows["pause"].append(pause)
    shadowed.close()
    paused = World(path, src, live)  # the ordinary refit: the engine stops for all of it
    for step in range(1, args.steps + 2):
        fill(100 + step)
        sync(device)
        t0 = time.perf_counter()
        _join(paused.run(list(paused.exs), step), start=False)
        sync(device)
        if step > 1:
            rows["paused"].append(time.perf_counter() - t0)
    ok = all(torch.equal(live[t][f"w{i}"], want(t, i)) for t in tgts for i in range(k))
    paused.close()
    if not ok:
        sys.exit(f"zero_pause {d}x{k}: the paused refit is not bit-exact")
    nbytes = k * d * d * SIZE[dtype]
    floor = nbytes / copy_bandwidth(nbytes, device)
    med = {key: statistics.median(v) if v else float("nan") for key, v in rows.items()}
    return dict(model=f"{d}x{k}", mib=nbytes / 2**20, **med, floor=floor)


def bench_chunked(d: int, k: int, args: argparse.Namespace, device: torch.device) -> dict:
    """The same model through a chunked shadow (`executor/chunked.py`): `--chunked C`
    chunks of ceil(K/C) weights, one buffer of that many bytes per target. The engine is
    stopped for the whole refit (its pause: `refit`), or, accepting the mixed versions,
    only for each chunk's switch (`switch`, the largest per step)."""
    from executor.chunked import ChunkedShadow, load_chunks, run_chunks
    from planner.passes.chunked import with_chunk_shadow
    from schemas.chunked_plan import write_chunked
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    tdt, S, T = getattr(torch, dtype), args.sources, args.targets
    per = -(-k // args.chunked)
    budget = per * d * d * SIZE[dtype]
    path = os.path.join(tempfile.mkdtemp(prefix="zero-pause-b-"), "p.rplan")
    plans = [with_chunk_shadow(make_plan(None, d, k, S, T, dtype, range(c, min(k, c + per))),
                          budget) for c in range(0, k, per)]
    write_chunked(path, plans, budget)
    src = {s: {f"t{t}.w{i}": torch.zeros(d, d, dtype=tdt, device=device)
               for t in range(S, S + T) for i in range(k) if i % S == s} for s in range(S)}
    live = {t: {f"w{i}": torch.zeros(d, d, dtype=tdt, device=device) for i in range(k)}
            for t in range(S, S + T)}
    fabric, out = Fabric(), {}

    def load(r: int) -> None:
        kw = dict(timeout_s=TIMEOUT_S, step_records=False, no_identity=True)
        out[r] = (load_chunks(path, r, src[r], transport="local", rendezvous=fabric,
                              **kw) if r < S else
                  ChunkedShadow.load(path, r, live[r], transport="local", rendezvous=fabric, **kw))
    _join([threading.Thread(target=_guarded(load, f"chunked load of rank {r}"), args=(r,))
           for r in range(S + T)])
    rows: dict[str, list[float]] = {"refit": [], "switch": []}
    for step in range(1, args.steps + 2):
        g = torch.Generator(device=device).manual_seed(200 + step)
        for named in src.values():
            for x in named.values():
                x.copy_(torch.randn(d, d, generator=g, device=device).mul_(d ** -0.5))
        sync(device)
        stats: dict[int, object] = {}

        def target(r: int, step: int = step, stats: dict = stats) -> None:
            stats[r] = out[r].run(step)
        t0 = time.perf_counter()
        _join([threading.Thread(target=_guarded(run_chunks, f"chunked source {r} step {step}"),
                                args=(out[r], step)) for r in range(S)]
              + [threading.Thread(target=_guarded(target, f"chunked target {r} step {step}"),
                                  args=(r,)) for r in range(S, S + T)])
        refit = time.perf_counter() - t0
        if not all(torch.equal(live[t][f"w{i}"], src[i % S][f"t{t}.w{i}"])
                   for t in live for i in range(k)) or len(stats) != T:
            sys.exit(f"zero_pause chunked {d}x{k} step {step}: not bit-exact")
        if step > 1:
            rows["refit"].append(refit)
            rows["switch"].append(max(max(st.switch_s) for st in stats.values()))
    for r in range(S + T):
        for ex in (out[r] if r < S else out[r].chunks):
            ex.close()
    return dict(model=f"{d}x{k}", budget_mib=budget / 2**20, chunks=len(plans),
                **{key: statistics.median(v) for key, v in rows.items()})


ERRORS: list[str] = []
"""What a rank's thread raised: `_join` ends the run with it in one line (a thread's
exception would otherwise vanish, and its peers wait out their timeout)."""
TIMEOUT_S = 120.0
"""Every executor's timeout here (`--timeout-s`): a rank that fails ends the run this soon."""


def _guarded(fn: Callable[..., object], what: str) -> Callable[..., None]:
    def go(*a: object) -> None:
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001 - reported by _join, in one line
            first = str(e).splitlines()[0] if str(e) else ""
            ERRORS.append(f"{what}: {type(e).__name__}: {first}")
    return go


def _join(threads: list[threading.Thread], start: bool = True) -> None:
    if start:
        for th in threads:
            th.start()
    for th in threads:
        th.join()
    if ERRORS:
        sys.exit(f"zero_pause: {ERRORS[0]}" + (f" (and {len(ERRORS) - 1} more)"
                                               if len(ERRORS) > 1 else ""))


def chunked_table(results: list[dict], full: list[dict]) -> str:
    lines = ["chunked shadow (executor/chunked.py): the engine paused for the whole refit "
             "(refit ms), or, accepting layers at N+1 beside layers at N, per chunk switch",
             "| model (chunked) | budget MiB | chunks | refit ms (paused throughout) | "
             "switch per chunk ms (largest) | full shadow pause ms | paused refit ms |",
             "|---|---|---|---|---|---|---|"]
    for r, f in zip(results, full):
        lines.append(f"| chunked {r['model']} | {r['budget_mib']:.2f} | {r['chunks']} | "
                     f"{1e3 * r['refit']:.2f} | {1e3 * r['switch']:.3f} | "
                     f"{1e3 * f['pause']:.3f} | {1e3 * f['paused']:.2f} |")
    return "\n".join(lines)


def table(results: list[dict], args: argparse.Namespace, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"zero_pause: {args.sources} sources -> {args.targets} targets, local transport, "
             f"{name}, batch {args.batch}, medians of {args.steps} steps, sources "
             f"{args.slow_source_ms:g} ms late",
             "| model (DxK) | MiB/target | decode ms | decode during ms | steps during | "
             "transfer ms | pause ms | floor ms | pause/floor | paused refit ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['mib']:.1f} | {1e3 * r['undisturbed']:.3f} | "
            f"{1e3 * r['during']:.3f} | {r['n_during']:.0f} | {1e3 * r['transfer']:.2f} | "
            f"{1e3 * r['pause']:.3f} | {1e3 * r['floor']:.3f} | "
            f"{r['pause'] / r['floor']:.2f} | {1e3 * r['paused']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    global TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="2048x8,4096x16,4096x64",
                    help="comma-separated DxK: K weights [D, D] per target rank")
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--targets", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--slow-source-ms", type=float, default=0.0,
                    help="the sources start each shadow step this late (a longer transfer: "
                    "the pause must not grow)")
    ap.add_argument("--timeout-s", type=float, default=TIMEOUT_S,
                    help="every executor's timeout: a failing rank ends the run this soon")
    ap.add_argument("--chunked", type=int, default=0, metavar="C",
                    help="also run each model through a chunked shadow of C chunks")
    ap.add_argument("--tiny", action="store_true", help="CPU, 128x4 and 256x4, 3 steps, "
                    "chunked in 2 chunks")
    args = ap.parse_args()
    TIMEOUT_S = args.timeout_s
    if args.tiny:
        args.models, args.steps, args.device = "128x4,256x4", 3, "cpu"
        args.chunked = args.chunked or 2
    if args.sources < 1 or args.targets < 1:
        sys.exit(f"zero_pause: --sources {args.sources} --targets {args.targets}: each must "
                 "be at least 1")
    try:
        models = [tuple(int(v) for v in m.split("x")) for m in args.models.split(",")]
        assert all(len(m) == 2 and m[0] > 0 and m[1] > 0 for m in models)
    except (ValueError, AssertionError):
        sys.exit(f"zero_pause: --models {args.models!r}: give DxK pairs, e.g. 2048x8,4096x16")
    device = torch.device(args.device)
    if device.type == "cpu":  # one thread: the decode and the copies share a busy box
        torch.set_num_threads(1)
    results = [bench_model(d, k, args, device) for d, k in models]
    print(table(results, args, device))
    if args.chunked > 0:
        print(chunked_table([bench_chunked(d, k, args, device) for d, k in models], results))


if __name__ == "__main__":
    main()
