"""One trainer rank sending through `rdma_plan`'s trainer engine (source side of the plan).

argv[1] is JSON: {"control": port, "cases": [...], "start": step index to begin at (a
restarted rank)}. Per case: the rank's tensors (the plan's source layout, version = the
first step's seed) in a vLLM `WeightSource`, `WeightTransferTrainerFactory.trainer_init`
(rank 0 is the sender and drives the engine through `vllm_cases.StoreClient`), then per step
new tensors in the source and `send_weights(weight_version)`. Every rank announces
`ready/<rank>/<label>` and waits for the sender's `go/<label>`; the sender has each worker
`check` its weights after every step. A step with `"die": rank` exits that rank (code 17)
instead of sending: a source killed mid-update. A step with `"torn_chunk": s` (a chunked plan)
has every rank send chunk 0 only, the workers waiting s seconds for chunk 1.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from harness.launch import master_store  # noqa: E402
from tests.integrations import vllm_cases  # noqa: E402

HOSTED: dict[str, object] = {}
"""Trainer rank 0: each case's rendezvous store (every rank and worker is a client of it)."""


def run_case(case: dict, rank: int, store, start: int) -> None:  # noqa: ANN001
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from integrations.vllm import RdmaPlanTrainerInitInfo

    name, steps, trainers = case["name"], case["steps"], case["trainers"]
    source = vllm_cases.dict_source(vllm_cases.source_tensors(case, rank, steps[start]["seed"]))
    client = vllm_cases.StoreClient(store, name, case["workers"])
    if rank == 0 and start == 0:  # the case's store, hosted here on a port the OS picks
        HOSTED[name], port = master_store(case["timeout_s"])  # while binding it (a port
        store.set(f"{name}/rdzv", str(port).encode())  # found free first was once taken by
    port = int(store.get(f"{name}/rdzv"))  # vLLM's own sockets before the executor bound it)
    info = RdmaPlanTrainerInitInfo(rank=rank, plan=case["plan"], rendezvous_hosted=True,
                                   rendezvous=f"127.0.0.1:{port}", timeout_s=case["timeout_s"],
                                   plan_rank=rank, no_identity=True,  # no framework here
                                   shadow=case.get("shadow", False),
                                   plan_key=os.path.join(os.path.dirname(case["plan"]),
                                                         "plan.key"))
    for w in range(case["workers"]):  # the plan's load timeout starts once vLLM is up
        store.get(f"{name}/built/{w}")
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    for i, step in enumerate(steps[start:], start):
        label = step["label"]
        source.tensors = vllm_cases.source_tensors(case, rank, step["seed"])  # new storage
        if rank != 0:
            store.set(f"{name}/ready/{rank}/{label}", b"1")
            store.get(f"{name}/go/{label}")
        else:
            for r in range(1, trainers):
                store.get(f"{name}/ready/{r}/{label}")
            client.call("skip_refresh", skip=bool(step.get("skip_refresh")))
            if case["chunked"]:
                client.call("timeout", s=step.get("torn_chunk") or case["timeout_s"])
            if case.get("shadow"):  # what the live weights must hold until finish
                client.call("expect_live", label=label,
                            seed=steps[i - 1]["seed"] if i else None)
            store.set(f"{name}/go/{label}", b"1")
        if step.get("die") == rank:
            os._exit(17)
        if step.get("torn_chunk"):  # this rank's chunk 0 only: the rest never lands
            engine.write = engine.chunks[0].run
        try:
            engine.send_weights(weight_version=label)
            result = "ok"
        except Exception as e:  # noqa: BLE001 - recorded for the test
            result = f"{type(e).__name__}: {e}"
        finally:
            vars(engine).pop("write", None)
        if rank == 0:
            client.call("skip_refresh", skip=False)
            client.call("check", label=label, seed=step.get("check_seed", step["seed"]),
                        torn=result != "ok",
                        new_seed=step["seed"] if step.get("torn_chunk") else None)
            store.set(f"{name}/send/{label}", json.dumps(
                {"result": result, "client_version": client.weight_version}))
    engine.shutdown()
    if rank == 0:
        for w in range(case["workers"]):
            store.set(f"{name}/rpc/{w}/{client.seq}", json.dumps({"method": "done"}))


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    from integrations.vllm import register

    register()
    store = vllm_cases.open_control(arg["control"])
    for case in arg["cases"]:
        run_case(case, rank, store, arg.get("start", 0))
        print(f"trainer {rank}: {case['name']} done", flush=True)


if __name__ == "__main__":
    main()
