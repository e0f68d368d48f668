"""One rank of the SGLang engine-level update test: RANK 0 is the trainer (one FSDP2 rank),
RANKs 1.. are the TP ranks of a real SGLang 0.5.23 engine on CPU driven through SGLang's
own scheduler handlers with the rdma-plan plugin (`integrations.sglang_engine`).

argv[1] is JSON: {"port", "store", "ctl", "plan", "hf", "steps", "torn", "world", "bind",
"chunked", "switch"}; `bind` is "rpc" (`rdma_plan_init` through `handle_rpc_request`, the
plugin's hook, as `Engine.collective_rpc` sends it) or "env" (`RDMA_PLAN_SGLANG`, bound by the
first `begin_weight_update`, as for an HTTP server); `chunked`: the plan is a chunked plan
(`target.shadow: {budget_bytes: N}`), the trainer sends it chunk by chunk (`run_chunks`)
and each engine rank receives it through the engine core's `run_step` (every chunk switched
into the live parameters before the next lands, the engine paused throughout).

What is real SGLang here: the model and its loader, the parallel groups (gloo), the
scheduler-level `SchedulerWeightUpdaterManager` (begin/end session, post-load), the
`Scheduler` class's own handlers (`init_request_dispatcher`'s table: `handle_rpc_request`,
`pause_generation`, `continue_generation`, `handle_update_weight_version`) and SGLang's
`HookRegistry` applying the plugin's hooks. What stands in: `Scheduler.__init__` (it builds
KV-cache pools, a TP worker and ZMQ sockets; a whole `sglang.Engine` on CPU was not carried
through here), so a
`Scheduler.__new__` object carries the few fields those handlers read; the TP worker is a
namespace holding the model runner's two fields (`model`, `weight_updater`); the
tokenizer manager's fan-out (ZMQ, then SGLang's broadcast to TP ranks) is a TCPStore:
the trainer posts each request once, every rank dispatches it, the trainer merges the
answers like `FanOutCommunicator.merge_results` (success only if every rank succeeded).

Every step the trainer runs `integrations.sglang_trainer.update` (pause, begin, send, end,
version, continue); every engine rank checks after it: every parameter and `w_kc`/`w_vc`
equal SGLang's own reference bit-exactly, `data_ptr`s unchanged, the scheduler's
`weight_version` is the step's, generation resumed. At step `torn` the trainer never
sends (chunked: sends chunk 0 only, the rest never lands): `end_weight_update` must be
refused on every rank (chunked: naming the chunk that did not land and the chunks
switched; chunk 0's parameters hold the step's weights, every later chunk's the last whole
version's), and a careless trainer's `update_weight_version` + `continue_generation` must
leave the version and the pause as they were; the next step re-arms the open session and
is whole.

After step `switch` (0: none) the trainer switches every rank to plan B, the same config
compiled with smaller writes (other op tables, the same memory: the engine runs no EPLB here,
so no other placement), through `integrations.sglang_switch.switch`: every TP rank checks
(`rdma_plan_switch` with `check_only`), then switches by the plugin's RPC while the trainer's
executor does; the later steps run through plan B, bit for bit; plan A sent again as version
1 is then refused on every rank (stale), naming the versions, the engine still on plan B.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import types
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import executor  # noqa: E402
from schemas.plan import STAGING  # noqa: E402
from tests.oracles import sglang_env  # noqa: E402
from tests.oracles.sglang_update_worker import differ, state  # noqa: E402

WAIT = timedelta(seconds=900)


def control(arg: dict, master: bool) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore("127.0.0.1", arg["ctl"], is_master=master,
                                      timeout=WAIT, wait_for_workers=False)


def fan_out(store: torch.distributed.TCPStore, engines: int):  # noqa: ANN201
    """The tokenizer manager's part: post a request to every rank, merge the answers."""
    counter = itertools.count()

    def call(endpoint: str, body: dict) -> dict:
        i = next(counter)
        store.set(f"req/{i}", json.dumps([endpoint, body]))
        keys = [f"rep/{i}/{r}" for r in range(engines)]
        store.wait(keys, WAIT)
        answers = [json.loads(store.get(k)) for k in keys]
        return {"success": all(a["success"] for a in answers),
                "message": " | ".join(a["message"] for a in answers)}
    return call


def bind_keys(arg: dict) -> dict:
    return {"plan": arg["plan"], "rendezvous": f"127.0.0.1:{arg['store']}", "timeout_s": 900.0,
            "allow_unsigned": True}  # the test's plan is unsigned (a job secret is set)


def trainer(arg: dict) -> None:
    from executor.chunked import load_chunks, run_chunks
    from harness.weights import materialize, random_full_tensors
    from integrations.errors import TornUpdateError
    from integrations.sglang_trainer import update
    from planner.frameworks import build_layout
    from planner.validate import load

    ctl = control(arg, True)
    call = fan_out(ctl, arg["world"] - 1)
    cfg, spec = load(arg["config"])
    lay = build_layout(spec, cfg.source)
    tensors = {n: t.clone() for n, t in
               materialize(lay, random_full_tensors(spec, seed=100), ranks=[0])[0].items()}
    # binding (the RPC, or with RDMA_PLAN_SGLANG the first begin_weight_update) and the
    # trainer's executor.load rendezvous with each other: the request goes from a thread
    first = ("rpc", {"method": "rdma_plan_init", "parameters": bind_keys(arg)}) \
        if arg["bind"] == "rpc" else ("begin_weight_update", {})
    answers: list[dict] = []
    bind = threading.Thread(target=lambda: answers.append(call(*first)))
    bind.start()
    load = load_chunks if arg["chunked"] else executor.load
    plan = load(arg["plan"], 0, tensors, transport="nixl",
                rendezvous=f"127.0.0.1:{arg['store']}", timeout_s=900,
                no_identity=True)  # the test's one source rank
    chunks = plan if arg["chunked"] else [plan]
    send = (lambda: run_chunks(chunks)) if arg["chunked"] else (lambda: executor.run(plan))
    bind.join()
    if arg["bind"] == "rpc":
        assert answers[0]["success"], answers
        answers = [call("begin_weight_update", {})]
    unpaused = answers[0]  # begin is refused while generation runs
    assert not unpaused["success"] and "pause_generation" in unpaused["message"], unpaused
    for ex in chunks:
        ex.timeout_s = 120.0
    for step in range(1, arg["steps"] + 1):
        new = materialize(lay, random_full_tensors(spec, seed=100 + step), ranks=[0])[0]
        for n, t in tensors.items():
            t.copy_(new[n])
        torn = step == arg["torn"]
        call("timeout", {"s": 5.0 if torn else 120.0})
        try:
            update(call, (lambda: chunks[0].run() if arg["chunked"] else None) if torn else send,
                   f"v{step}", empty_cache=False)
            assert not torn, "a torn update was accepted"
        except TornUpdateError as e:
            assert torn, e
            assert not arg["chunked"] or (f"chunk 1 of {len(chunks)} did not complete" in str(e)
                                          and "chunks 0..0 were switched" in str(e)), e
            print(f"trainer: step {step} refused: {e}", flush=True)
            call("update_weight_version", {"new_version": f"v{step}",
                                           "abort_all_requests": False})
            call("continue_generation", {"torch_empty_cache": False})
        checked = call("check", {"step": step, "torn": torn})
        assert checked["success"], checked["message"]
        print(f"trainer: step {step} checked", flush=True)
        if step == arg.get("switch"):
            switch_plans(arg, call, plan)
    call("done", {})  # every engine rank has closed its plan: stop hosting the store
    for ex in chunks:
        ex.close()


def switch_plans(arg: dict, call, plan: executor.Executor) -> None:  # noqa: ANN001
    """Plan B compiled, every rank switched to it, plan A then refused as stale (above)."""
    import yaml

    from integrations.sglang_switch import switch
    from planner.compiler import compile_file

    with open(arg["config"]) as f:
        cfg = yaml.safe_load(f)
    cfg["options"] = {**cfg.get("options", {}), "max_write_bytes": 8192}
    path_b = os.path.join(os.path.dirname(arg["plan"]), "plan-b.rplan")
    with open(os.path.join(os.path.dirname(arg["config"]), "plan-b.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    compile_file(f.name, path_b)
    switch(call, plan, path_b, 1, no_identity=True)  # the test's one source rank
    running = call("plan", {})["message"].split(" | ")
    assert running == [f"{plan.fingerprint} 1"] * (arg["world"] - 1), running
    assert plan.switches == 1 and plan.register_calls == 1, (plan.switches,
                                                             plan.register_calls)
    stale = call("rpc", {"method": "rdma_plan_switch",
                         "parameters": {"plan": arg["plan"], "version": 1}})
    assert not stale["success"], stale
    assert stale["message"].count("not newer than the running plan's 1") == arg["world"] - 1
    assert call("plan", {})["message"].split(" | ") == running  # still plan B
    print(f"trainer: switched to plan B ({plan.fingerprint[:16]}); plan A as version 1 "
          f"refused: {stale['message'].split(' | ')[0]}", flush=True)


def scheduler_of(live: torch.nn.Module, updater: object):  # noqa: ANN201
    """A real `Scheduler` (class, handlers, dispatcher) without `__init__` (see above)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.runtime_context import get_parallel

    s = Scheduler.__new__(Scheduler)
    runner = types.SimpleNamespace(model=live, weight_updater=updater)
    s.tp_worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", runner)])
    s.tp_group = get_parallel().tp_group
    s._engine_paused, s._pause_started_at, s._pause_intervals = False, None, []
    s.disaggregation_mode = DisaggregationMode.NULL
    s.running_batch = s.last_batch = s.chunked_req = s.hisparse_coordinator = None
    s.waiting_queue, s.result_queue, s.enable_continuous_input_polling = [], [], False
    s.flush_wrapper = types.SimpleNamespace(handle=None)  # unused entry of the table
    s.weight_updater = SchedulerWeightUpdaterManager(
        tp_worker=s.tp_worker, draft_worker=None, memory_saver_adapter=None,
        flush_cache=lambda: True, is_fully_idle=lambda **_: True, scheduler=s)
    s.init_request_dispatcher()
    return s


def check(s, live, ref, ptrs, body: dict, versions: list[str],  # noqa: ANN001
          load_step) -> str:  # noqa: ANN001
    """'' when the engine is as step `body` requires, else what is wrong (`load_step()`
    loads the step's weights into the reference `ref`)."""
    from sglang.srt.runtime_context import get_serving

    from integrations.sglang_engine import rank_state, status

    st, version = status(s), get_serving().weight_version
    if body["torn"]:
        if not (st["torn"] and s._engine_paused and version == versions[-1]):
            return f"torn step {body['step']}: status {st}, paused {s._engine_paused}, " \
                   f"version {version!r} (want {versions[-1]!r})"
        why = torn_chunks(rank_state(s).target, live, ref, load_step)
        return f"torn step {body['step']}: {why}" if why else ""
    versions.append(f"v{body['step']}")
    bad = differ(state(live), state(ref))
    moved = [n for n, t in state(live).items() if t.data_ptr() != ptrs[n]]
    if bad or moved or st["torn"] or s._engine_paused or version != versions[-1]:
        return f"step {body['step']}: differ {bad[:3]}, moved {moved[:3]}, status {st}, " \
               f"paused {s._engine_paused}, version {version!r}"
    return ""


def torn_chunks(target, live, ref, load_step) -> str:  # noqa: ANN001
    """'' when a chunked plan's torn step (chunk 0 sent, the rest never) left chunk 0's
    parameters at the step's weights (`load_step()` loads them into `ref`) and every later
    chunk's at the last whole version's (what `ref` holds before), its failure naming the
    chunk; else what is wrong. '' for an ordinary plan."""
    if target.budget is None:
        return ""
    why = str(target.failure)
    if not ("chunk 1 of" in why and "chunks 0..0 were switched" in why):
        return f"the torn chunked step's failure does not name the chunk: {why}"
    chunks = [[g.name for g in rp.regions if g.name != STAGING] for _, rp in target.parts]
    later = [n for chunk in chunks[1:] for n in chunk]
    have, old = state(live), state(ref)
    kept = differ({n: have[n] for n in later}, {n: old[n] for n in later})
    load_step()
    new = state(ref)
    switched = differ({n: have[n] for n in chunks[0]}, {n: new[n] for n in chunks[0]})
    if kept or switched or not later or not chunks[0]:
        return (f"later chunks not kept at the last version: {kept[:3]}; chunk 0 not at the "
                f"step's: {switched[:3]} ({len(chunks[0])} + {len(later)} tensors)")
    return ""


def engine_rank(arg: dict, rank: int, world: int) -> None:
    sglang_env.prepare()
    from sglang.srt.managers import io_struct
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.plugins.hook_registry import HookRegistry

    from harness.weights import random_full_tensors
    from integrations.sglang_engine import ENV, rank_state, register
    from planner.spec import spec_from_hf

    if arg["bind"] == "env":
        os.environ[ENV] = json.dumps(bind_keys(arg))
    register()  # what load_plugins() does with the entry point, then it applies the hooks
    HookRegistry.apply_hooks()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(arg["port"]))
    sglang_env.init_world(rank, world, arg["port"])
    args = sglang_env.server_args(arg["hf"], tp=world, dtype="bfloat16")
    spec, cpu = spec_from_hf(arg["hf"], mtp=False), torch.device("cpu")

    def checkpoint(seed: int):  # the trainer's weights at that step: bf16, fp32 buffers
        return iter((n, t if spec.by_name[n].buffer else t.to(torch.bfloat16))
                    for n, t in random_full_tensors(spec, seed=seed).items())

    live = sglang_env.build(args, rank)
    DefaultModelLoader.load_weights_and_postprocess(live, checkpoint(100), cpu)  # startup
    ref = sglang_env.build_model_only(args, rank)
    updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=rank, model_config=None,
                            custom_weight_loaders={}, get_model=lambda: live,
                            update_model_fields=None, recapture_cuda_graph=None,
                            get_model_runner=None)
    s = scheduler_of(live, updater)
    types_of = {"rpc": io_struct.RpcReqInput,
                "pause_generation": io_struct.PauseGenerationReqInput,
                "begin_weight_update": io_struct.BeginWeightUpdateReqInput,
                "end_weight_update": io_struct.EndWeightUpdateReqInput,
                "update_weight_version": io_struct.UpdateWeightVersionReqInput,
                "continue_generation": io_struct.ContinueGenerationReqInput}
    ctl, ptrs, versions = control(arg, False), state(live), [None]
    ptrs = {n: t.data_ptr() for n, t in ptrs.items()}
    for i in itertools.count():
        ctl.wait([f"req/{i}"], WAIT)
        endpoint, body = json.loads(ctl.get(f"req/{i}"))
        answer = {"success": True, "message": ""}
        if endpoint == "done":
            rank_state(s).target.close()
        elif endpoint == "plan":  # the running plan and its version (the switch's check)
            t = rank_state(s).target
            answer["message"] = f"{t.header.fingerprint} {t.plan_version}"
        elif endpoint == "timeout":
            target = rank_state(s).target
            for ex in target.chunked.chunks if target.chunked is not None else [target.plan]:
                ex.timeout_s = body["s"]
        elif endpoint == "check":
            def load_step(step: int = body["step"]) -> None:
                DefaultModelLoader.load_weights_and_postprocess(ref, checkpoint(100 + step),
                                                                cpu)
            if not body["torn"]:
                load_step()
            why = check(s, live, ref, ptrs, body, versions, load_step)
            answer = {"success": not why, "message": f"rank {rank}: {why}" if why else ""}
        else:
            out = s._request_dispatcher(types_of[endpoint](**body))
            if hasattr(out, "success"):
                answer = {"success": out.success, "message": out.message}
        print(f"rank {rank}: {endpoint} -> {answer}", flush=True)
        ctl.set(f"rep/{i}/{rank}", json.dumps(answer))
        if endpoint == "done":
            break
    sglang_env.teardown()


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        trainer(arg)
    else:
        engine_rank(arg, rank - 1, world - 1)


if __name__ == "__main__":
    main()
