"""Trace ahead: a traced target layout that is not cached is traced in a forked process
started when the compile starts, while this process builds the source side.

Tracing imports torch and vLLM (the larger part of a trace) and builds
every engine rank's model; none of it needs the source layout, and the source layout and
its piece table need nothing of the trace. So `begin` forks a tracer (it imports vLLM, traces
the engine with its own workers, sends the ranks as `traced.encode_rank` rows, then writes
the cache file) and `Pending.result` joins it. This process never imports torch or vLLM, so
the rest of the compile does not pay for their millions of objects in every garbage
collection.
The tracer imports vLLM lean (`vllm_lean`) with RDMA_PLAN_TRACE_LEAN=1: what that leaves
out refuses any use, so a trace needing it fails rather than answering otherwise, and a lean
tracer that fails is followed by one importing vLLM whole (lean and whole traces are compared
by tests/oracles/test_vllm_trace_lean.py). The tracer's answer is checked like a cache file
(`traced.decode_rank`); what it traced is what `traced.layout` traces in this process (the
same `traced.trace_packed`), so the plan is the same bytes. Without `fork` (or on a cache
hit) nothing starts early: `result` builds the layout then, as `build_layout` would.

For a family with hand-written rules, the trace is expected to equal them (a test checks
it for every such family): `guess` builds the rules' layout so that the compile can go on
with it while the tracer works, and `confirms` compares the tracer's rows, undecoded, with
the rules' engine encoded the same way (`traced.encode_rank`). Equal rows are equal
layouts, so the plan compiled with the guess is the traced layout's plan, byte for byte;
rows that differ, or rules that refuse the config, leave `result` to decode the trace, and
the plan is compiled from it. The trace itself is never skipped.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack

from planner.collector import gc_paused
from planner.errors import TraceError
from planner.layouts import traced
from planner.layouts.base import Layout
from planner.spec import ModelSpec
from schemas.config import ConfigError, TargetConfig

log = logging.getLogger("planner")

Then = Callable[[Layout], Layout]


def _same(layout: Layout) -> Layout:
    return layout


class Pending:
    """A target layout on its way: `result()` waits for it, `cancel()` stops its tracer.
    A context manager: leaving the block cancels a tracer still running (an error on the
    source side must not leave a process tracing behind it). While a trace runs, `guess()`
    gives the layout it is expected to equal, if any, and `confirms(guess)` says whether it
    did (then `result()` is that guess)."""

    def __init__(self, build: Callable[[], Layout], then: Then = _same,
                 rules: Callable[[], Layout] | None = None,
                 cfg: TargetConfig | None = None) -> None:
        self._build, self._then = build, then
        self._proc: Any = None
        self._rows: Callable[[], list[bytes]] | None = None  # the tracer's answer, packed
        self._rules, self._cfg = rules, cfg
        self._guess: tuple[Layout, Layout] | None = None  # the rules' layout, and `then` of it
        self._confirmed = False

    def result(self) -> Layout:
        if self._confirmed and self._guess is not None:
            return self._guess[1]
        return self._then(self._build())

    def guess(self) -> Layout | None:
        """The hand-written layout (`then` applied) that the trace under way is expected to
        equal; None without a trace under way or rules for the family, or when the rules
        refuse the config (the trace decides then)."""
        if self._rules is None or self._rows is None or self._proc is None:
            return None
        try:
            rules = self._rules()
            self._guess = (rules, self._then(rules))
        except Exception as e:  # noqa: BLE001 - rules that cannot build it: the trace decides
            log.info("no hand-written guess to compare with the trace: %s: %s",
                     type(e).__name__, e)
            return None
        return self._guess[1]

    def confirms(self, guess: Layout) -> bool:
        """Waits for the trace (raising its error, as `result()` would) and says whether it
        equals `guess`, what `guess()` gave: every engine rank's rows are the rules'
        engine's, and the rules' replicas are that engine's (`traced.replicated`)."""
        if self._guess is None or self._guess[1] is not guess or self._rows is None:
            return False
        rules, cfg = self._guess[0], self._cfg
        assert cfg is not None
        engine = [r.tensors for r in rules.ranks[:cfg.engine_world]]
        want = [msgpack.packb(traced.encode_rank(tensors)) for tensors in engine]  # made
        same = rules == traced.replicated(engine, cfg)  # before the wait
        rows = self._rows()  # each rank's rows as msgpack bytes, as the tracer packed them
        self._confirmed = same and rows == want
        return self._confirmed

    def cancel(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the tracer and its workers
            except (ProcessLookupError, PermissionError):
                proc.kill()
        if proc is not None:
            proc.join(timeout=10)

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def begin(spec: ModelSpec, cfg: TargetConfig, hf: dict[str, Any], folder: str | None = None,
          then: Then = _same) -> Pending:
    """`traced.layout(spec, cfg, hf, folder)`, begun now: on a cache miss a forked tracer
    starts at once (a bad setting is refused here, before it starts); `then` is applied to
    the layout when `result()` gives it (the FP8 quantization of a traced bf16 engine)."""
    traced.check(spec, cfg)
    folder = folder or traced.cache_dir()
    key = traced.cache_key(hf, cfg)
    path = traced.cache_path(folder, key)
    engine = traced.read_cache(path, key, spec, cfg.engine_world)
    if engine is not None:
        return Pending(lambda: traced.replicated(engine, cfg), then)
    if "fork" not in multiprocessing.get_all_start_methods():
        return Pending(lambda: traced.layout(spec, cfg, hf, folder), then)

    def start(lean: bool) -> tuple[Any, Any]:
        return _fork(spec, hf, replace(cfg, replicas=1), path, key, lean)

    def rules() -> Layout:
        from planner.layouts import vllm

        return vllm.layout(spec, replace(cfg, layout="rules"))

    proc, recv = start(lean_wanted())
    hand_written = spec.dims.model_type in traced.HAND_WRITTEN
    pending = Pending(lambda: _decoded(answer(), spec, cfg), then,
                      rules if hand_written else None, cfg)
    rows: list[list[bytes]] = []

    def answer() -> list[bytes]:
        if not rows:
            rows.append(_join(pending, start, recv, cfg.engine_world))
        return rows[0]

    pending._rows, pending._proc = answer, proc
    return pending


def lean_wanted() -> bool:
    """Whether the tracer tries the lean import of vLLM first (`vllm_lean`): opt-in, with
    RDMA_PLAN_TRACE_LEAN=1; else vLLM is imported whole."""
    return os.environ.get("RDMA_PLAN_TRACE_LEAN", "0") == "1"


def _fork(spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig, path: str, key: str,
          lean: bool) -> tuple[Any, Any]:
    """A tracer (not a daemon: it starts workers) and the pipe it answers on."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_tracer, args=(send, spec, hf, cfg, path, key, lean))
    proc.start()
    send.close()
    return proc, recv


def _join(pending: Pending, start: Callable[[bool], tuple[Any, Any]], recv: Any,
          world: int) -> list[bytes]:
    """The tracer's `world` ranks, packed; then the tracer is reaped (it only writes the
    cache file after answering). A lean tracer that failed is followed by one importing
    vLLM whole (its failure may be the lean import's)."""
    rows = _receive(recv, world)
    if rows is None:
        pending.cancel()
        pending._proc, recv = start(False)
        rows = _receive(recv, world)
    if rows is None or isinstance(rows, str):
        pending.cancel()
        raise TraceError(rows or "target.layout: traced: the tracing process failed")
    if pending._proc is not None:
        pending._proc.join(timeout=60)  # it writes the cache file
    pending.cancel()  # reaps it (kills it only if that write hangs)
    return rows


def _decoded(rows: list[bytes], spec: ModelSpec, cfg: TargetConfig) -> Layout:
    """The tracer's ranks decoded and checked (as `traced.read_cache` does), replicated."""
    try:
        with gc_paused():
            engine = [traced.decode_rank(msgpack.unpackb(rank, strict_map_key=True), spec)
                      for rank in rows]
    except (ValueError, TypeError, KeyError, IndexError, msgpack.StackError) as e:
        raise TraceError(f"target.layout: traced: the tracing process sent a bad answer ({e})"
                         ) from None
    return traced.replicated(engine, cfg)


def _receive(recv: Any, world: int) -> list[bytes] | str | None:
    """`_answer` to what the tracer sends on `recv` (then closed)."""
    try:
        with gc_paused():
            return _answer(recv.recv_bytes(), world)
    except EOFError:
        return ("target.layout: traced: the tracing process died without an answer (out "
                "of memory?); retry, or set RDMA_PLAN_CACHE to a folder holding a trace")
    finally:
        recv.close()


def _answer(data: bytes, world: int) -> list[bytes] | str | None:
    """The tracer's `world` ranks as it sent them (each rank's `traced.encode_rank` rows as
    msgpack bytes, unchecked), the one-line error it sent or that its answer earns, or
    None: a lean tracer failed."""
    try:
        raw = msgpack.unpackb(data, strict_map_key=True)
        if isinstance(raw, dict) and raw.get("lean") is True:
            return None
        if isinstance(raw, dict) and "error" in raw:
            return str(raw["error"])[:4000]
        ranks = raw["ranks"]
        if not isinstance(ranks, list) or len(ranks) != world or not all(
                isinstance(r, bytes) for r in ranks):
            raise ValueError(f"not {world} ranks")
        return ranks
    except (ValueError, TypeError, KeyError, IndexError) as e:
        return f"target.layout: traced: the tracing process sent a bad answer ({e})"


def _tracer(send: Any, spec: ModelSpec, hf: dict[str, Any], cfg: TargetConfig, path: str,
            key: str, lean: bool = False) -> None:
    """The forked tracer: answers `{"ranks": rows}` or `{"error": line}` (with `"lean":
    true` when it imported vLLM lean: try again without), then caches."""
    os.setpgid(0, 0)  # its own group, so that `cancel` stops its workers with it
    gc.disable()  # a short-lived process: nothing it allocates needs collecting
    try:
        if lean:
            from planner.layouts import vllm_lean

            lean = vllm_lean.install()
        else:
            log.info("the tracer imports vLLM whole (RDMA_PLAN_TRACE_LEAN=1: lean)")
        out: dict[str, Any] = {"ranks": traced.trace_packed(spec, hf, cfg)}
    except ConfigError as e:
        out = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (a failure of vLLM or torch: named in one line)
        out = {"error": f"target.layout: traced: tracing failed ({type(e).__name__}: "
                        f"{str(e)[:300]})"}
    if lean and "error" in out:
        out["lean"] = True
    send.send_bytes(msgpack.packb(out))
    send.close()
    if "ranks" in out:
        traced.cache_quietly(path, key, out["ranks"])
