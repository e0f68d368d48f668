"""The trainer's side of the SGLang engine plugin (`integrations/sglang_engine.py`):
`load_source(plan, binding, ...)` (a trainer rank's part of the plan, from the binding its
adapter returned, held to the live framework), `Call` over SGLang's HTTP API (`http(url)`)
or an in-process `sglang.Engine` (`in_process(engine)`), `update(call, send, version)`
(pause, begin, the sources' writes, end, version, resume), `finish_unflushed` after
`CacheNotFlushedError`, and `engine_digests` (each TP rank's sha256 of the tensors the plan
writes on it)."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import executor
from executor import trust
from integrations import Binding, trainer
from integrations.errors import CacheNotFlushedError, TornUpdateError
from schemas.errors import UserError

log = logging.getLogger(__name__)

NOT_FLUSHED = "rdma-plan: weights written, prefix cache not flushed"
"""How `end_weight_update`'s answer starts when the weights are whole but SGLang refused
to flush its prefix cache (requests still running or held in place by the pause)."""


def load_source(plan: str, binding: Binding, *, rendezvous: str, transport: str = "nixl",
                timeout_s: float = 60.0, plan_key: str | None = None,
                allow_unsigned: bool = False, **options: Any
                ) -> executor.Executor | list[executor.Executor]:
    """This trainer rank's part of `plan` for an SGLang target, from the `Binding` its
    adapter returned (`integrations.megatron.bind(plan, model)`, `integrations.fsdp2.bind`):
    the framework's live state is read again and must select the binding's plan rank, its
    identity must be the plan's for that rank and the part compiled for it (every chunk's,
    for a chunked plan; all refused in one line before anything is registered); then the
    binding's tensors are loaded (`integrations.trainer.load`). Run it inside `update`'s
    `send`: `executor.run`, or for a chunked plan (a list, one executor per chunk)
    `executor.run_chunks`."""
    where = f"rdma_plan trainer plan rank {binding.rank} ({plan})"
    trust.signing(plan_key, allow_unsigned, where=where)
    rank, identity = trainer.plan_rank(plan, binding, None, None, binding.rank, where)
    chunked, _ = trainer.checked_parts(plan, rank, identity, False, plan_key, binding, where)
    o = executor.LoadOptions(transport=transport, rendezvous=rendezvous, timeout_s=timeout_s,
                             plan_key=plan_key, identity=identity, **options)
    return trainer.load(plan, rank, trainer.bound_tensors(binding, None, where), chunked, o)


Call = Callable[[str, dict[str, Any]], dict[str, Any]]
"""Posts one SGLang endpoint with a JSON body, returns the JSON answer (also on HTTP 400)."""


def http(url: str, timeout_s: float = 600.0) -> Call:
    """`Call` over an SGLang server's HTTP API at `url` (e.g. http://host:30000)."""
    def call(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"{url.rstrip('/')}/{endpoint}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return _answer(r.read(), True)
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise
            return _answer(e.read(), False)
    return call


def _answer(body: bytes, ok: bool) -> dict[str, Any]:
    """A JSON answer, or a text one (`/flush_cache`) as {"success", "message"}."""
    try:
        return json.loads(body or b"{}")
    except ValueError:
        return {"success": ok, "message": body.decode(errors="replace").strip()}


def in_process(engine: Any) -> Call:
    """`Call` for an in-process `sglang.Engine`: the engine's and its tokenizer manager's
    methods that SGLang's HTTP endpoints of the same names run, and "rpc" ({"method",
"parameters"}: `Engine.collective_rpc`, the plugin's methods). Call it from the thread
    that created the engine (its ZMQ sockets belong to that thread)."""
    from sglang.srt.managers import io_struct as io

    tm = engine.tokenizer_manager
    forwarded = {"pause_generation": (tm.pause_generation, io.PauseGenerationReqInput),
                 "continue_generation": (tm.continue_generation,
                                         io.ContinueGenerationReqInput),
                 "update_weight_version": (tm.update_weight_version,
                                           io.UpdateWeightVersionReqInput)}

    def call(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        if endpoint in ("begin_weight_update", "end_weight_update"):
            ok, message = getattr(engine, endpoint)(**body)[:2]
            return {"success": bool(ok), "message": message}
        if endpoint == "rpc":  # Engine.collective_rpc: asserts every rank's success
            try:
                engine.collective_rpc(body["method"], **(body.get("parameters") or {}))
            except AssertionError as e:
                return {"success": False, "message": str(e)}
            return {"success": True, "message": ""}
        if endpoint == "flush_cache":
            out = engine.flush_cache()
            return {"success": bool(out.success), "message": out.message}
        if endpoint not in forwarded:
            raise UserError(f"in_process: endpoint {endpoint!r} is not one update() "
                            f"posts; use one of {sorted(forwarded)}, flush_cache, rpc or "
                            "begin/end_weight_update")
        method, request = forwarded[endpoint]
        engine.loop.run_until_complete(method(request(**body)))
        return {"success": True, "message": ""}
    return call


def engine_digests(engine: Any, folder: str) -> dict[int, dict[str, str]]:
    """{target rank: {tensor: sha256}} of every TP rank of an in-process `sglang.Engine`
    (keyed as `harness.weights.layout_digests` of the plan's target layout keys them), each
    computed by that rank on its own bound tensors (`rdma_plan_digests` through
    `engine.collective_rpc`; `folder`: a directory the engine's processes can write)."""
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".json"):
            os.remove(os.path.join(folder, name))
    engine.collective_rpc("rdma_plan_digests", out=folder)
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                body = json.load(f)
            out[int(body["rank"])] = body["digests"]
    return out


def update(call: Call, send: Callable[[], object], version: str,
           empty_cache: bool = True, pause_mode: str = "in_place") -> None:
    """One update of one engine: pause (`pause_mode`: SGLang's "in_place", "retract" or
    "abort"), begin, the sources' `send()`, end (refused when torn: raises
    `TornUpdateError`, the engine stays paused with its old version; call `update` again),
    then the version and resume. With "in_place" and requests in flight, SGLang cannot
    flush its prefix cache: `CacheNotFlushedError` (weights whole, version not committed,
    engine paused); "retract" moves the requests back to the queue so the flush succeeds
    (they recompute with the new weights)."""
    call("pause_generation", {"mode": pause_mode})
    begun = call("begin_weight_update", {})
    if not begun.get("success"):
        raise TornUpdateError(f"begin_weight_update refused: {begun.get('message')}")
    try:
        send()
    except Exception as e:  # noqa: BLE001  (the engine's end decides and says why)
        log.error("rdma-plan: send failed: %s", e)
    ended = call("end_weight_update", {})
    message = str(ended.get("message") or "")
    if not ended.get("success") and message.startswith(NOT_FLUSHED):
        raise CacheNotFlushedError(
            f"{message}; version {version!r} was not committed and the engine stays paused. "
            f"Do not resend: finish_unflushed(call, {version!r}) retracts the held requests "
            "(they recompute with the new weights), flushes the cache, commits the version "
            "and resumes; next time pause with pause_mode='retract' (or 'abort') or drain "
            "requests before update", version)
    if not ended.get("success"):
        raise TornUpdateError(f"end_weight_update refused: {ended.get('message')}; the "
                              f"engine stays paused, version not set to {version!r}")
    call("update_weight_version", {"new_version": version, "abort_all_requests": False})
    call("continue_generation", {"torch_empty_cache": empty_cache})


def finish_unflushed(call: Call, version: str, empty_cache: bool = True) -> None:
    """Complete an update that raised `CacheNotFlushedError`: pause with "retract" (the
    requests held in place go back to the queue, their old-weight KV freed), flush the
    prefix cache, commit `version`, resume. Raises `CacheNotFlushedError` again if SGLang
    still refuses the flush (e.g. a PD-decode request holds transferred KV)."""
    call("pause_generation", {"mode": "retract"})
    flushed = call("flush_cache", {})
    if not flushed.get("success"):
        raise CacheNotFlushedError(f"{NOT_FLUSHED}: flush_cache refused after retracting "
                                   f"the requests ({flushed.get('message')}); version "
                                   f"{version!r} not committed, the engine stays paused: "
                                   "abort the remaining requests and call this again",
                                   version)
    call("update_weight_version", {"new_version": version, "abort_all_requests": False})
    call("continue_generation", {"torch_empty_cache": empty_cache})
