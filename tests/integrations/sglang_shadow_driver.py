"""A live `sglang.Engine` (SGLang 0.5.23, CPU) refitted in shadow mode (`integrations/
sglang_shadow.py`): the engine generates while the transfer runs, then switches.

Run as a script (argv[1] is JSON: {"hf", "plan", "tp", "steps", "delay_s", "out"};
the plan compiled with `target.shadow: full`). Like `sglang_live_driver.py` (whose checks
it reuses), bound with `rdma_plan_init(..., shadow=True)`; per step,
`update_shadow(call, start, send, version)` where `send` runs the trainer's source rank on
a thread (after `delay_s`: a slow source) while this thread keeps generating through the
engine, and checks:
- requests were served while the update was in flight (counted), every one with the
  previous version's prompt logprobs, also after the bytes landed in the shadow;
- after the switch every HF tensor read back equals the trainer's bytes, the logprobs
  equal transformers' on the trainer's tensors, the weight_version is the new one;
then a torn update (started, no source sends; `finish_timeout_s`): `update_shadow` raises,
generation resumes, and the engine serves the last version unchanged.
Figures (pause, transfer, tokens served during the transfer) go to `out` as JSON.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_live_driver as live  # noqa: E402  (sets sys.path, stubs, SGLANG_PLUGINS)


def main() -> None:
    import sglang

    import executor
    from harness.weights import random_full_tensors
    from integrations.errors import TornUpdateError
    from integrations.sglang_shadow import update_shadow
    from integrations.sglang_trainer import in_process
    from planner.spec import spec_from_hf

    arg = json.loads(sys.argv[1])
    hf, tp, delay = arg["hf"], int(arg["tp"]), float(arg["delay_s"])
    folder = tempfile.mkdtemp(prefix="sglang-shadow-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    spec = spec_from_hf(hf, mtp=False)
    os.environ.setdefault("RDMA_PLAN_SECRET", secrets.token_hex(32))
    engine = sglang.Engine(model_path=folder, device="cpu", tp_size=tp, dtype="float32",
                           load_format="dummy", skip_tokenizer_init=True,
                           disable_cuda_graph=True, max_total_tokens=1024,
                           max_running_requests=4, random_seed=0, log_level="error")
    figures: dict = {"tp": tp, "delay_s": delay, "steps": []}
    try:
        tensors = {n: t.clone() for n, t in random_full_tensors(spec, seed=100).items()}
        plan = live.bind(engine, arg, tensors, shadow=True)
        before = live.engine_logprobs(engine)[0]
        call = in_process(engine)
        for step in range(1, int(arg["steps"]) + 1):
            for n, t in random_full_tensors(spec, seed=100 + step).items():
                tensors[n].copy_(t)
            seen: dict = {"requests": 0, "tokens": 0, "max_diff": 0.0, "sent": []}

            def source(seen: dict = seen) -> None:
                # a slow source: the update stays in flight meanwhile, at least `delay` and
                # until the engine served two requests (one takes seconds on a loaded box)
                start, cap = time.monotonic(), time.monotonic() + delay + 300
                while ((time.monotonic() - start < delay or seen["requests"] < 2)
                       and time.monotonic() < cap):
                    time.sleep(0.01)
                s = time.perf_counter()
                executor.run(plan)
                seen["sent"].append(time.perf_counter() - s)

            def send(seen: dict = seen, before: list = before) -> None:  # generates meanwhile
                th = threading.Thread(target=source)
                th.start()
                while th.is_alive() or seen["requests"] == 0:
                    lps, ids, _ = live.engine_logprobs(engine)
                    seen["requests"] += 1
                    seen["tokens"] += len(ids)
                    seen["max_diff"] = max(seen["max_diff"], *(abs(a - b) for a, b in
                                                               zip(lps, before, strict=True)))
                th.join()
                landed = live.engine_logprobs(engine)[0]  # in the shadow, not switched
                seen["max_diff"] = max(seen["max_diff"], *(abs(a - b) for a, b in
                                                           zip(landed, before, strict=True)))

            pause_s = update_shadow(call, lambda: engine.collective_rpc(
                "rdma_plan_shadow_start"), send, f"v{step}")
            assert seen["max_diff"] == 0.0, f"step {step}: served {seen['max_diff']} off " \
                "the previous version during the transfer"
            assert len(seen["sent"]) == 1 and seen["requests"] >= 2, seen
            bad = live.engine_differs(engine, tensors, tp)
            assert not bad, f"step {step}: engine differs from the trainer in {bad}"
            lps, ids, greedy, delta, version = live.served(engine, hf, tensors)
            print(f"driver: step {step}: {seen['requests']} requests ({seen['tokens']} tokens)"
                  f" served during the update, all on the previous version; after the switch "
                  f"bit-exact, |delta logprob| {delta:.2e}, version {version!r}, pause "
                  f"{pause_s * 1e3:.1f} ms, transfer {seen['sent'][0] * 1e3:.1f} ms (after "
                  f"a {delay:g} s delay)", flush=True)
            assert delta < 1e-3 and ids == greedy, (delta, ids, greedy)
            assert version == (f"v{step}",) * 2, version
            figures["steps"].append({"step": step, "pause_s": pause_s,
                                     "transfer_s": seen["sent"][0],
                                     "served_requests": seen["requests"],
                                     "served_tokens": seen["tokens"]})
            before = lps
        # torn: the update starts, no source sends; the engine keeps serving the last version
        try:
            update_shadow(call, lambda: engine.collective_rpc(
                "rdma_plan_shadow_start", finish_timeout_s=3.0), lambda: None, "torn")
            raise AssertionError("a torn shadow update was not refused")
        except TornUpdateError as e:
            print(f"driver: torn update refused: {str(e)[:160]}", flush=True)
        lps = live.engine_logprobs(engine)[0]
        assert lps == before, "the torn update changed what the engine serves"
        assert engine.get_model_info()["weight_version"] == f"v{arg['steps']}"
        print("driver: after the torn update the engine serves the last version", flush=True)
    finally:
        engine.shutdown()
    live.report(arg["out"], figures)


if __name__ == "__main__":
    main()
