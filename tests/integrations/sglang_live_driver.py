"""A live `sglang.Engine` (SGLang 0.5.23, CPU) refitted through the rdma-plan plugin.

Run as a script (argv[1] is JSON: {"hf", "config", "plan", "tp", "steps", "out",
"switch"}). It does
what a user does: `sglang.Engine(...)` in this process (its scheduler processes load the
plugin by its entry point, `SGLANG_PLUGINS=rdma_plan`), binds with
`engine.collective_rpc("rdma_plan_init", ...)` while the trainer's source rank (this
process, one FSDP2 rank holding the full HF tensors) runs `executor.load` over NIXL, then
per step: new trainer weights, `integrations.sglang_trainer.update(call, send, version)`
with `call = in_process(engine)` (the engine's own methods that SGLang's HTTP endpoints of
the same names run), and checks:
- every HF tensor read back through SGLang's own `Engine.get_weights_by_name` equals the
  trainer's bytes (float32: the list SGLang returns holds every value exactly);
- every TP rank's own shard, byte for byte: the sha256 of each tensor the plan writes on
  that rank, computed by the rank itself (`engine_digests`: the plugin's
  `rdma_plan_digests` through `engine.collective_rpc`), equals the sha256 of the tensor the
  plan's target layout builds from the trainer's tensors (`harness.weights.layout_digests`);
  before the first update (random startup weights) they differ;
- the engine's prompt logprobs of fixed token ids equal a reference forward of
  transformers' `LlamaForCausalLM` on the trainer's tensors (within fp32 tolerance), and
  changed from the previous version's;
- the engine's greedy tokens (4 after the prompt) equal transformers' greedy tokens;
- the engine reports the new weight_version and stamps it on its outputs.
With `switch`, after step 1 every rank switches to a plan B by the plugin's
`rdma_plan_switch` (`switch_plans`), so the later updates run through plan B.
Then, with a long request running (held in place by the pause): `update` raises
`CacheNotFlushedError` (not `TornUpdateError`); every rank holds the new bytes; the version
stays; `finish_unflushed` completes it (logprobs checked). Last, `update(...,
pause_mode="retract")` with a request running succeeds. Figures (pause, transfer per update)
go to `out` as JSON.

The only thing not installed as a user would have it: `torchvision` and `setproctitle`
(SGLang imports both; a user installs them, the test's `--no-deps` SGLang folder lacks
them) are stubbed by `sglang_env.prepare()` at import of this module, which SGLang's spawned
scheduler processes re-run (multiprocessing re-imports the main script in each child).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("SGLANG_PLUGINS", "rdma_plan")

from tests.oracles import sglang_env  # noqa: E402

sglang_env.prepare()

import torch  # noqa: E402

PROMPT = [5, 17, 99, 312, 7, 64, 1001, 250, 3, 42]


def engine_logprobs(engine) -> tuple[list[float], list[int], dict]:  # noqa: ANN001
    out = engine.generate(input_ids=PROMPT, return_logprob=True, logprob_start_len=0,
                          sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    lp = out["meta_info"]["input_token_logprobs"]
    return [float(x[0]) for x in lp[1:]], out["output_ids"], out["meta_info"]


def reference(hf: dict, tensors: dict[str, torch.Tensor], new: int
              ) -> tuple[list[float], list[int]]:
    """transformers' `LlamaForCausalLM` on the trainer's tensors: the prompt logprobs and
    `new` greedy tokens (argmax of a full forward per token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures",)})
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = list(PROMPT)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return [float(lp[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)], ids[len(PROMPT):]


def engine_differs(engine, tensors: dict[str, torch.Tensor], tp: int) -> list[str]:  # noqa: ANN001
    """The HF tensors whose bytes SGLang's `get_weights_by_name` does not give back. It
    answers TP rank 0's part: at TP 1 the whole tensor (the embedding and head with the
    rows SGLang pads the vocabulary with: 1100 -> 1152, not compared); at TP > 1 the
    first rows of a column-parallel tensor (q, k, v, gate, up, the vocabulary), the
    all-gathered row-parallel ones (o_proj, down_proj) and the replicated norms whole."""
    bad = []
    for n, t in tensors.items():
        got = engine.get_weights_by_name(n, truncate_size=1 << 30)
        got = torch.tensor(got, dtype=torch.float64) if got is not None else None
        if got is not None and got.dim() == t.dim() and got.shape[1:] == t.shape[1:]:
            if "embed" in n or "lm_head" in n:
                got = got[:min(t.shape[0], got.shape[0])]
            if tp > 1 and got.shape[0] < t.shape[0]:
                t = t[:got.shape[0]]
        if got is None or got.shape != t.shape or not torch.equal(got, t.double()):
            bad.append(n)
    return bad


def long_request(engine):  # noqa: ANN001, ANN201 (an asyncio task on the engine's loop)
    """A request that runs for seconds (ignore_eos), started on the engine's loop and given
    a second to reach the scheduler's running batch."""
    task = engine.loop.create_task(engine.async_generate(
        input_ids=PROMPT[:4], sampling_params={"max_new_tokens": 900, "temperature": 0.0,
                                               "ignore_eos": True}))
    engine.loop.run_until_complete(asyncio.sleep(1.0))
    assert not task.done(), "the long request ended before the update began"
    return task


def served(engine, hf: dict, tensors: dict[str, torch.Tensor]  # noqa: ANN001
           ) -> tuple[list[float], list[int], list[int], float, tuple]:
    """What the engine serves against transformers on `tensors`: its prompt logprobs, its
    greedy tokens, transformers' greedy tokens, max |delta logprob|, and (the version the
    engine reports, the one it stamps on its outputs)."""
    lps, ids, meta = engine_logprobs(engine)
    ref, greedy = reference(hf, tensors, len(ids))
    delta = max(abs(a - b) for a, b in zip(lps, ref, strict=True))
    version = (engine.get_model_info()["weight_version"], meta.get("weight_version"))
    return lps, ids, greedy, delta, version


def serves(engine, hf: dict, tensors: dict[str, torch.Tensor], label: str,  # noqa: ANN001
           task) -> tuple[float, tuple]:  # noqa: ANN001
    """The engine serves `tensors` as version `label` (its prompt logprobs and greedy tokens
    against transformers', the version it reports and stamps); then the long request `task`
    is aborted and awaited. Returns max |delta logprob| and the versions."""
    _, ids, greedy, delta, version = served(engine, hf, tensors)
    assert delta < 1e-3 and ids == greedy and version == (label,) * 2, \
        (label, delta, ids, greedy, version)
    engine.tokenizer_manager.abort_request(abort_all=True)
    engine.loop.run_until_complete(task)
    return delta, version


HOSTED: list = []
"""The rendezvous stores `bind` hosted."""


def bind(engine, arg: dict, tensors: dict[str, torch.Tensor], **init: object):  # noqa: ANN001, ANN201
    """The trainer's source rank (this process: `executor.load` on a thread) and the engine's
    binding (`rdma_plan_init` through `collective_rpc`, keyword `init` added) rendezvous at a
    store this process hosts on a port the OS picks while binding it (the engine's ranks its
    clients: `rendezvous_hosted`); the source's `Executor`, its peer timeout then 120 s."""
    import executor
    from harness.launch import master_store

    store, port = master_store(300.0)
    HOSTED.append(store)  # kept while the engine runs
    rendezvous, loaded = f"127.0.0.1:{port}", []

    def load() -> None:
        try:
            loaded.append(executor.load(arg["plan"], 0, tensors, transport="nixl",
                                        rendezvous=store, timeout_s=300,
                                        no_identity=True))  # the test's one source rank
        except BaseException as e:  # noqa: BLE001
            loaded.append(e)
    thread = threading.Thread(target=load)
    thread.start()
    # the engine's ZMQ sockets belong to this thread: the RPC goes from here
    engine.collective_rpc("rdma_plan_init", plan=arg["plan"], rendezvous=rendezvous,
                          rendezvous_hosted=True, timeout_s=300.0, allow_unsigned=True,
                          **init)  # unsigned plan
    thread.join()
    plan = loaded[0]
    assert not isinstance(plan, BaseException), plan
    plan.timeout_s = 120.0
    return plan


def switch_plans(call, plan, arg: dict) -> None:  # noqa: ANN001
    """Every rank to plan B (the same config with smaller writes: other op tables, the same
    memory; this engine runs no EPLB) by the plugin's `rdma_plan_switch` through
    `in_process(engine)`'s "rpc" (`Engine.collective_rpc`), checked on every rank first;
    then plan A as version 1 refused (stale). The later updates run through plan B."""
    import yaml

    from integrations.sglang_switch import switch
    from planner.compiler import compile_file

    folder = os.path.dirname(arg["config"])
    with open(arg["config"]) as f:
        cfg = yaml.safe_load(f)
    cfg["options"] = {**cfg.get("options", {}), "max_write_bytes": 16384}  # same staging
    with open(os.path.join(folder, "plan-b.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    path_b = os.path.join(folder, "plan-b.rplan")
    compile_file(os.path.join(folder, "plan-b.yaml"), path_b)
    old = plan.fingerprint
    switch(call, plan, path_b, 1, no_identity=True)  # the test's one source rank
    assert plan.switches == 1 and plan.register_calls == 1 and plan.fingerprint != old
    stale = call("rpc", {"method": "rdma_plan_switch",
                         "parameters": {"plan": arg["plan"], "version": 1}})
    assert not stale["success"] and "not newer than the running plan's 1" in \
        stale["message"], stale
    print(f"driver: switched every rank to plan B ({plan.fingerprint[:16]}) by "
          f"rdma_plan_switch; plan A as version 1 refused: {stale['message'][:200]}",
          flush=True)


def report(out: str, figures: dict) -> None:
    """The driver's figures to `out` (JSON), and its last line."""
    with open(out, "w") as f:
        json.dump(figures, f)
    print("driver: ok", flush=True)


def check_ranks(engine, folder: str, want: dict, tp: int, label: str) -> int:  # noqa: ANN001
    """Every TP rank's own digests equal `want` ({target rank: {name: sha256}})."""
    from integrations.sglang_trainer import engine_digests

    got = engine_digests(engine, folder)
    assert sorted(got) == list(range(tp)), f"{label}: digests from target ranks {sorted(got)}"
    for r in range(tp):
        bad = sorted(n for n in want[r] if got[r].get(n) != want[r][n])
        assert got[r].keys() == want[r].keys() and not bad, \
            f"{label}: plan rank {r}: {len(bad)} tensor(s) differ from the trainer's: {bad[:4]}"
    return sum(len(w) for w in want.values())


def main() -> None:
    import sglang

    import executor
    from harness.weights import layout_digests, random_full_tensors
    from integrations.errors import CacheNotFlushedError, TornUpdateError
    from integrations.sglang_trainer import (
        engine_digests,
        finish_unflushed,
        in_process,
        update,
    )
    from planner.frameworks import build_layout
    from planner.spec import spec_from_hf
    from schemas.config_load import load_config

    arg = json.loads(sys.argv[1])
    hf, tp = arg["hf"], int(arg["tp"])
    folder = tempfile.mkdtemp(prefix="sglang-live-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    spec = spec_from_hf(hf, mtp=False)
    target = build_layout(spec, load_config(arg["config"]).target, hf)
    sums = tempfile.mkdtemp(prefix="sglang-digests-")
    # the job secret: every rank (the scheduler processes inherit it) authenticates with it
    os.environ.setdefault("RDMA_PLAN_SECRET", secrets.token_hex(32))
    t0 = time.perf_counter()
    engine = sglang.Engine(model_path=folder, device="cpu", tp_size=tp, dtype="float32",
                           load_format="dummy", skip_tokenizer_init=True,
                           disable_cuda_graph=True, max_total_tokens=1024,
                           max_running_requests=4, random_seed=0, log_level="error")
    print(f"driver: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    figures: dict = {"tp": tp, "engine_start_s": time.perf_counter() - t0, "steps": []}
    try:
        tensors = {n: t.clone() for n, t in random_full_tensors(spec, seed=100).items()}
        plan = bind(engine, arg, tensors)
        before, ids, _ = engine_logprobs(engine)  # dummy (random) startup weights
        print(f"driver: bound; dummy-weight greedy tokens {ids}", flush=True)
        # the negative control: the startup weights are not the trainer's, rank by rank
        want = layout_digests(target, tensors)
        got = engine_digests(engine, sums)
        same = sum(got[r].get(n) == d for r in want for n, d in want[r].items())
        assert sorted(got) == list(range(tp)) and same == 0, (sorted(got), same)
        print(f"driver: startup weights: 0 of {sum(map(len, want.values()))} rank shards "
              "equal the trainer's (the digest check can fail)", flush=True)
        call, timed, sent = in_process(engine), {}, []

        def timed_call(endpoint: str, body: dict) -> dict:
            timed[endpoint] = time.perf_counter()
            return call(endpoint, body)

        for step in range(1, int(arg["steps"]) + 1):
            for n, t in random_full_tensors(spec, seed=100 + step).items():
                tensors[n].copy_(t)
            sent.clear()

            def send() -> None:
                s = time.perf_counter()
                executor.run(plan)
                sent.append(time.perf_counter() - s)
            s = time.perf_counter()
            update(timed_call, send, f"v{step}")
            done = time.perf_counter()
            pause_s = done - timed["pause_generation"]
            bad = engine_differs(engine, tensors, tp)
            assert not bad, f"step {step}: engine differs from the trainer in {bad}"
            shards = check_ranks(engine, sums, layout_digests(target, tensors), tp,
                                 f"step {step}")
            lps, ids, greedy, delta, version = served(engine, hf, tensors)
            moved = max(abs(a - b) for a, b in zip(lps, before, strict=True))
            print(f"driver: step {step}: {len(tensors)} tensors bit-exact, {shards} rank "
                  f"shards' sha256 equal the trainer's on {tp} rank(s), max |delta "
                  f"logprob| vs transformers {delta:.2e}, vs previous version {moved:.2e}, "
                  f"version {version!r}, greedy {ids}, pause {pause_s * 1e3:.1f} ms, "
                  f"transfer {sent[0] * 1e3:.1f} ms", flush=True)
            assert delta < 1e-3, f"step {step}: logprobs differ from the reference by {delta}"
            assert ids == greedy, f"step {step}: greedy tokens {ids}, transformers' {greedy}"
            assert moved > 1e-2, f"step {step}: logprobs did not change ({moved})"
            assert version == (f"v{step}",) * 2, f"step {step}: weight_version {version!r}"
            figures["steps"].append({"step": step, "pause_s": pause_s,
                                     "transfer_s": sent[0], "update_s": done - s,
                                     "max_delta_logprob": delta})
            before = lps
            if step == 1 and arg.get("switch"):
                switch_plans(call, plan, arg)
        steps = int(arg["steps"])

        def new_weights(seed: int) -> None:
            for n, t in random_full_tensors(spec, seed=seed).items():
                tensors[n].copy_(t)

        # an update ended while a request runs (held in place by the pause)
        new_weights(200)
        task = long_request(engine)
        try:
            update(call, lambda: executor.run(plan), "held")
            raise AssertionError("update returned although a request was running")
        except TornUpdateError as e:
            raise AssertionError(f"a whole update reported as torn: {e}") from e
        except CacheNotFlushedError as e:
            error = str(e)
        old = engine.get_model_info()["weight_version"]
        shards = check_ranks(engine, sums, layout_digests(target, tensors), tp, "held")
        assert old == f"v{steps}", f"version moved to {old!r} without a flushed cache"
        assert "weights written, prefix cache not flushed" in error and "'held'" in error \
            and "not committed" in error and "retract" in error, error
        print(f"driver: held request: CacheNotFlushedError ({error[:160]}...); {shards} "
              f"shards equal the trainer's, version stays {old!r}", flush=True)
        finish_unflushed(call, "held")
        delta, version = serves(engine, hf, tensors, "held", task)
        print(f"driver: finish_unflushed: version {version!r}, max |delta logprob| "
              f"{delta:.2e}", flush=True)
        # the same with pause_mode="retract": the running request goes back to the queue
        new_weights(300)
        task = long_request(engine)
        update(call, lambda: executor.run(plan), "retracted", pause_mode="retract")
        shards = check_ranks(engine, sums, layout_digests(target, tensors), tp, "retract")
        delta, version = serves(engine, hf, tensors, "retracted", task)
        print(f"driver: pause_mode='retract' with a request running: {shards} shards equal, "
              f"version {version!r}, max |delta logprob| {delta:.2e}", flush=True)
        figures["held"] = {"error": error, "retract_delta": delta}
        plan.close()
    finally:
        engine.shutdown()
    report(arg["out"], figures)


if __name__ == "__main__":
    main()
