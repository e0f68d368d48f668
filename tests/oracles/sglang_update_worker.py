"""One rank of the SGLang update test: RANK 0 is the trainer (one FSDP2 rank holding the
full HF tensors), RANKs 1.. are a real SGLang 0.5.23 engine's TP ranks on CPU.

argv[1] is JSON: {"port", "store", "plan", "hf", "steps", "torn"}. Every step the trainer
writes the weights of seed 100+step with the plan over NIXL; each engine rank runs the
update through `integrations.sglang.SGLangTarget` (SGLang's own `WeightUpdater` begin/end
through `begin_weight_update`/`end_weight_update`) and compares every parameter and the
derived `w_kc`/`w_vc` bit-exactly with SGLang's own reference: a second model of the same
rank that loaded the same checkpoint through SGLang's loader (`load_weights` + post-load
processing). Also checked: every `data_ptr` unchanged over all steps; before
`end_weight_update()` the derived tensors are stale (the refresh is needed); at step `torn`
the trainer skips its part, so `receive()` times out and `end_weight_update()` must refuse
(TornUpdateError) with the version unchanged; the next step is whole.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import executor  # noqa: E402
from tests.oracles import sglang_env  # noqa: E402


def trainer(arg: dict) -> None:
    from harness.weights import materialize, random_full_tensors
    from planner.frameworks import build_layout
    from planner.validate import load

    cfg, spec = load(arg["config"])
    lay = build_layout(spec, cfg.source)
    tensors = {n: t.clone() for n, t in
               materialize(lay, random_full_tensors(spec, seed=100), ranks=[0])[0].items()}
    plan = executor.load(arg["plan"], 0, tensors, transport="nixl",  # engines build slowly
                         rendezvous=f"127.0.0.1:{arg['store']}", timeout_s=900,
                         no_identity=True)  # the test's one source rank
    plan.timeout_s = 120.0
    engines = [f"{r}" for r in range(1, arg["world"])]
    for step in range(1, arg["steps"] + 1):
        new = materialize(lay, random_full_tensors(spec, seed=100 + step), ranks=[0])[0]
        for n, t in tensors.items():
            t.copy_(new[n])
        if step == arg["torn"]:
            print(f"trainer: skipping step {step}", flush=True)
            plan.store.store.wait([f"test/torn-seen/{r}" for r in engines], timedelta(seconds=600))
            continue
        executor.run(plan)
        print(f"trainer: step {step} sent", flush=True)
    # host the store (rank 0) until every engine rank has checked its last step
    plan.store.store.wait([f"test/done/{r}" for r in engines], timedelta(seconds=600))
    plan.close()


def derived_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{a}": getattr(m, a) for n, m in model.named_modules()
            for a in ("w_kc", "w_vc") if isinstance(getattr(m, a, None), torch.Tensor)}


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p.data for n, p in model.named_parameters()}, **derived_tensors(model)}


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return [n for n in a if not torch.equal(a[n], b[n])]


def torn_step(target, versions: list[str], step: int, rank: int) -> None:  # noqa: ANN001
    """The trainer never sends: receive() times out, end_weight_update() refuses, the
    version stays."""
    from integrations.errors import TornUpdateError

    target.plan.timeout_s = 5.0
    try:
        target.receive()
        raise AssertionError("receive() returned without the trainer's writes")
    except executor.PeerTimeoutError:
        pass
    try:
        target.end_weight_update(f"v{step}")
        raise AssertionError("end_weight_update() accepted a torn update")
    except TornUpdateError as e:
        print(f"rank {rank}: torn update refused: {e}", flush=True)
    assert target.version == versions[-1] == f"v{step - 1}", (target.version, versions)
    target.plan.timeout_s = 120.0
    target.plan.store.set(f"test/torn-seen/{rank + 1}", b"1")


def engine_rank(arg: dict, rank: int, world: int) -> None:
    sglang_env.prepare()
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import get_parallel

    from harness.weights import random_full_tensors
    from integrations.sglang import SGLangTarget
    from planner.spec import spec_from_hf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(arg["port"]))
    sglang_env.init_world(rank, world, arg["port"])
    args = sglang_env.server_args(arg["hf"], tp=world, dtype="bfloat16")
    spec = spec_from_hf(arg["hf"], mtp=False)
    cpu = torch.device("cpu")

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
    versions: list[str] = []
    target = SGLangTarget(live, arg["plan"], updater=updater, parallel=get_parallel(),
                          rendezvous=f"127.0.0.1:{arg['store']}", timeout_s=900,
                          commit_version=versions.append,
                          allow_unsigned=True)  # the test's plan is unsigned (logged)
    target.plan.timeout_s = 120.0
    ptrs = {n: t.data_ptr() for n, t in state(live).items()}
    assert target.derived and all(f"{e['module']}.{w}" in ptrs
                                  for e in target.derived for w in e["writes"])
    for step in range(1, arg["steps"] + 1):
        DefaultModelLoader.load_weights_and_postprocess(ref, checkpoint(100 + step), cpu)
        target.begin_weight_update()
        if step == arg["torn"]:
            torn_step(target, versions, step, rank)
            continue
        target.receive()
        stale = differ(state(live), state(ref))
        assert stale and all(n.endswith(("w_kc", "w_vc")) for n in stale), stale
        target.end_weight_update(f"v{step}")
        bad = differ(state(live), state(ref))
        assert not bad, f"step {step}: differ from SGLang's reference: {bad[:5]}"
        moved = [n for n, t in state(live).items() if t.data_ptr() != ptrs[n]]
        assert not moved, f"step {step}: data_ptr changed: {moved[:5]}"
        assert target.version == versions[-1] == f"v{step}"
        print(f"rank {rank}: step {step} bit-exact ({len(ptrs)} tensors, "
              f"{len(stale)} derived refreshed)", flush=True)
    target.plan.store.set(f"test/done/{rank + 1}", b"1")
    target.close()
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
