"""rdma_plan as a vLLM 0.33 weight-transfer backend, against real vLLM on CPU.

Two vLLM workers (TP 2 over gloo, `vllm_engine_worker.py`: the real VllmConfig with
`WeightTransferConfig(backend="rdma_plan")`, the engine built by vLLM's
`WeightTransferEngineFactory`) and two trainer ranks (`vllm_trainer_worker.py`: the trainer
engine from `WeightTransferTrainerFactory.trainer_init` with a `WeightSource`, sending over
NIXL, the sender driving the workers through a `VLLMWeightSyncClient`). After every
`send_weights`, every parameter, buffer and MLA `W_UK_T`/`W_UV` of each worker must equal
vLLM's own reference bit for bit (a fresh model that loaded the version's checkpoint through
`load_weights` and then ran post-load processing) and keep its `data_ptr`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import oracles

pytestmark = [pytest.mark.oracle, pytest.mark.extended]
oracles.require("vllm")
pytest.importorskip("nixl")


from harness.launch import master_store  # noqa: E402
from tests.integrations import vllm_cases as vc  # noqa: E402
from tests.support.clock import guard_s, no_answer  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MEGATRON_TP2 = dict(framework="megatron", tp=2)
FSDP2_DP2 = dict(framework="fsdp2", dp=2)


def steps(*seeds: int, **extra: dict) -> list[dict]:
    return [dict(label=f"v{s}", seed=s, **extra.get(f"v{s}", {})) for s in seeds]


CHUNK_BUDGET = 1 << 18
"""A chunked plan's buffer: four chunks of the tiny Qwen3 on each vLLM worker."""
TORN_CHUNK_S = 10.0
"""The workers' wait for a chunk the trainers never send (their executors' timeout then)."""

CASES = [  # name, HF config, source, target ep, steps[, shadow[, chunked plan's budget]]
    ("qwen3-tp2", vc.QWEN3, MEGATRON_TP2, False, steps(1, 2, 3)),
    ("qwen3-tied-tp2", vc.QWEN3 | dict(tie_word_embeddings=True), MEGATRON_TP2, False,
     steps(4)),
    ("qwen3_moe-tp2-ep", vc.QWEN3_MOE, FSDP2_DP2, True, steps(5)),
    ("deepseek_v3-tp2", vc.DEEPSEEK, FSDP2_DP2, False, steps(6)),
    ("deepseek_v3-fp8-tp2", vc.DEEPSEEK_FP8, MEGATRON_TP2, False,
     steps(7, 8, 9, 10, v10=dict(skip_refresh=True))),
    ("qwen3-shadow-tp2", vc.QWEN3, MEGATRON_TP2, False, steps(31, 32), True),
    # v42: the trainers send chunk 0 only; the workers wait TORN_CHUNK_S for chunk 1
    ("qwen3-chunked-tp2", vc.QWEN3, MEGATRON_TP2, False,
     steps(41, 42, 43, v42=dict(torn_chunk=TORN_CHUNK_S, check_seed=41)), False, CHUNK_BUDGET),
]


def compile_case(tmp: Path, name: str, hf: dict, source: dict, ep: bool,
                 budget: int | None = None) -> str:
    from planner.compiler import compile_config, compile_to
    from planner.spec import load_spec
    from planner.validate import validate
    from schemas.plan_write import write_plan

    folder = tmp / name
    folder.mkdir()
    cfg = vc.plan_config(hf, source, 2, ep, str(folder), budget)
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    path = str(folder / "plan.rplan")
    key = folder / "plan.key"  # signed: trainers and workers load it with plan_key
    key.write_bytes(os.urandom(32))
    if budget is not None:  # one file of chunk plans
        compile_to(cfg, spec, path, sign_key=key.read_bytes())
    else:
        write_plan(path, compile_config(cfg, spec), key=key.read_bytes())
    return path


def case_dict(tmp: Path, name: str, hf: dict, source: dict, ep: bool, st: list[dict],
              shadow: bool = False, budget: int | None = None, timeout_s: float = 60.0
              ) -> dict:
    plan = compile_case(tmp, name, hf, source, ep, budget)
    return dict(name=name, hf=hf, source=source, tp=2, ep=ep, folder=str(tmp / name),
                plan=plan, steps=st, timeout_s=timeout_s, trainers=2,
                workers=2, shadow=shadow, chunked=budget is not None)


class Procs:
    """The worker and trainer processes of one test; killed (by pid) if still running."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store, self.port = master_store(30)
        self.env = {**os.environ, "RDMA_PLAN_SECRET": secrets.token_hex(32),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "PYTHONWARNINGS": "ignore", "NIXL_LOG_LEVEL": "ERROR",
                    "UCX_LOG_LEVEL": "fatal", "WORLD_SIZE": "2"}
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, key: str, script: str, rank: int, arg: dict) -> None:
        log = open(self.tmp / f"{key}.log", "w")  # noqa: SIM115 - closed with the process
        self.procs[key] = subprocess.Popen(
            [sys.executable, str(HERE / script), json.dumps({**arg, "control": self.port})],
            env={**self.env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, key: str, timeout: float) -> int:
        try:
            return self.procs[key].wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"{no_answer(key, timeout)}\n{self.logs()}") from None

    def logs(self) -> str:
        return "\n".join(f"--- {k}\n{(self.tmp / f'{k}.log').read_text()[-3000:]}"
                         for k in self.procs)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def check(self, case: str, rank: int, label: str) -> dict:
        return json.loads(self.store.get(f"{case}/check/{rank}/{label}"))

    def during(self, case: str, rank: int, label: str) -> dict:
        return json.loads(self.store.get(f"{case}/during/{rank}/{label}"))

    def sent(self, case: str, label: str) -> dict:
        return json.loads(self.store.get(f"{case}/send/{label}"))


def start(tmp: Path, cases: list[dict]) -> Procs:
    procs = Procs(tmp)
    gloo = f"file://{tmp}/gloo-{secrets.token_hex(4)}"  # no port to find free first
    for r in range(2):
        procs.spawn(f"worker{r}", "vllm_engine_worker.py", r, {"gloo": gloo, "cases": cases})
    for r in range(2):
        procs.spawn(f"trainer{r}", "vllm_trainer_worker.py", r, {"cases": cases})
    return procs


def finish(procs: Procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    codes = {k: procs.wait(k, max(1.0, deadline - time.monotonic())) for k in procs.procs}
    assert not any(codes.values()), f"exit codes {codes}\n{procs.logs()}"


NEEDS = {"test_shadow_keeps_serving_the_previous_version_until_finish": "qwen3-shadow-tp2",
         "test_fp8_refresh_is_needed": "deepseek_v3-fp8-tp2",
         "test_a_torn_chunk_is_refused_by_every_worker_then_the_next_update_is_whole":
             "qwen3-chunked-tp2"}
"""The case each test besides `test_send_weights_bit_exact` reads."""


def selected_cases(session: pytest.Session) -> list[str]:
    """The CASES this session's selected tests read (all of them when run alone; the deep
    profile selects a few): the run builds, compiles and refits only those."""
    names = set()
    for item in session.items:
        if item.path != Path(__file__):
            continue
        if item.originalname == "test_send_weights_bit_exact":
            names.add(CASES[item.callspec.params["index"]][0])
        elif item.originalname in NEEDS:
            names.add(NEEDS[item.originalname])
    return [c[0] for c in CASES if c[0] in names]


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[Procs, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("vllm-engine")
    wanted = selected_cases(request.session)
    cases = [case_dict(tmp, *c) for c in CASES if c[0] in wanted]
    procs = start(tmp, cases)
    try:
        finish(procs, guard_s(90.0 * len(cases)))
    finally:
        procs.close()
    return procs, {c["name"]: c for c in cases}


def complete_steps(procs: Procs, case: dict) -> list[tuple[str, int, dict]]:
    out = []
    for step in case["steps"]:
        if step.get("skip_refresh") or step.get("torn_chunk"):
            continue
        assert procs.sent(case["name"], step["label"]) == {
            "result": "ok", "client_version": step["label"]}
        out += [(step["label"], r, procs.check(case["name"], r, step["label"]))
                for r in range(2)]
    return out


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_send_weights_bit_exact(run: tuple[Procs, dict[str, dict]], index: int) -> None:
    procs, cases = run
    case = cases[CASES[index][0]]
    checked = complete_steps(procs, case)
    assert checked
    for label, rank, c in checked:
        where = f"{case['name']} {label} worker {rank}"
        assert c["errors"] == [], f"{where}: {c['errors'][:10]}"
        assert c["moved"] == [], f"{where}: data_ptr changed: {c['moved'][:10]}"
        assert c["weight_version"] == label and c["compared"] > 10
        assert c["identity"]["tp"] == rank and c["identity"]["index"] == rank
        assert c["identity"]["ep"] == (rank if case["ep"] else 0)
        fp8 = "quantization_config" in case["hf"]
        assert c["derived"] == (2 if fp8 else 0), where  # W_UK_T/W_UV of both MLA layers
        # a chunked plan: every chunk received and switched by the worker's engine core
        assert (c["chunks"] >= 2) if case["chunked"] else c["chunks"] == 0, (where, c)


def test_shadow_keeps_serving_the_previous_version_until_finish(
        run: tuple[Procs, dict[str, dict]]) -> None:
    """Shadow mode (`integrations/vllm_shadow.py`): after `update_weights` returned, every
    tensor the engine reads still equals the previous version bit for bit (v32: vLLM's
    reference of v31; v31: the state before the update); after finish, the new version
    (`test_send_weights_bit_exact` checks that), every data_ptr kept. Each update records
    its transfer and pause on the worker."""
    procs, _ = run
    for rank in range(2):
        for label in ("v31", "v32"):
            d = procs.during("qwen3-shadow-tp2", rank, label)
            assert d["compared"] > 10 and d["errors"] == [], (label, d["errors"][:10])
        c = procs.check("qwen3-shadow-tp2", rank, "v32")
        ups = c["shadow"]
        assert [u["version"] for u in ups] == ["v31", "v32"], ups
        assert all(u["transfer_s"] > 0 and u["pause_s"] >= u["switch_s"] > 0 for u in ups)


def test_fp8_refresh_is_needed(run: tuple[Procs, dict[str, dict]]) -> None:
    """Negative control: the same update without the derived-state refresh leaves exactly
    the MLA W_UK_T/W_UV stale (the comparison fails), everything else equal."""
    procs, _ = run
    assert procs.sent("deepseek_v3-fp8-tp2", "v10")["result"] == "ok"
    for rank in range(2):
        c = procs.check("deepseek_v3-fp8-tp2", rank, "v10")
        stale = {e.split(":")[0] for e in c["errors"]}  # MLAAttention registers them too
        assert stale == {f"model.layers.{i}.self_attn.{m}{a}" for i in range(2)
                         for m in ("", "mla_attn.mla_attn.") for a in ("W_UK_T", "W_UV")}, \
            c["errors"]


def test_a_torn_chunk_is_refused_by_every_worker_then_the_next_update_is_whole(
        run: tuple[Procs, dict[str, dict]]) -> None:
    """A chunked plan (four chunks on each worker) whose trainers send chunk 0 only at v42
    (`torn_chunk`): each worker's engine core switches chunk 0 and gives chunk 1 up after
    `TORN_CHUNK_S`; the workers agree it is torn, the update is refused naming chunk 1 and
    the chunks switched, and `finish_weight_update` refuses to commit on every worker; the
    version stays v41, chunk 0's tensors hold v42 and every later chunk's v41 bit for bit;
    v43 starts again at chunk 0 and is whole and bit-exact
    (`test_send_weights_bit_exact[qwen3-chunked-tp2]`)."""
    procs, cases = run
    name = "qwen3-chunked-tp2"
    torn = procs.sent(name, "v42")
    assert torn["client_version"] == "v41" and torn["result"].startswith("TornUpdateError")
    assert torn["result"].count("did not reach every vLLM worker") == 1, torn["result"]
    n = procs.check(name, 0, "v42")["of_chunks"]
    assert n >= 3, n  # chunk 1 torn, chunk 2 and after never started
    for rank in range(2):  # the one error names every worker's chunk
        assert f"worker {rank}: ChunkedShadow: rank {2 + rank}: chunk 1 of {n} did not " \
            "complete" in torn["result"], torn["result"]
    assert torn["result"].count("chunks 0..0 were switched") == 2, torn["result"]
    for rank in range(2):
        c = procs.check(name, rank, "v42")
        assert c["weight_version"] == "v41" and c["chunks"] == 1, c
        assert c["finish"].startswith(f"rdma_plan: vLLM worker {rank}") and \
            f"chunk 1 of {n} did not complete" in c["finish"] and \
            "chunks 0..0 were switched" in c["finish"] and "'v41' stays" in c["finish"], c
        t = c["torn_chunks"]
        assert t["chunk0"] and t["later"], t  # both sides of the cut hold tensors
        assert t["chunk0_not_new"] == [] and t["later_not_old"] == [], t
        assert c["errors"] and {e.split(":")[0] for e in c["errors"]} <= set(t["chunk0"]), \
            c["errors"]  # against v41: chunk 0 alone moved on
        assert c["moved"] == [], c["moved"]
    assert procs.sent(name, "v43") == {"result": "ok", "client_version": "v43"}
    for rank in range(2):
        c = procs.check(name, rank, "v43")
        assert c["errors"] == [] and c["chunks"] == n and c["weight_version"] == "v43", c


@pytest.mark.parametrize("shadow", [False, True], ids=["paused", "shadow"])
def test_source_killed_mid_update(tmp_path: Path, shadow: bool) -> None:
    """Trainer rank 1 dies at v22 after the sender started the update: the workers agree it
    is torn and exactly one of them raises, the last one (the client reads the replies as
    vLLM's `collective_rpc` does, stopping at the first failure: a second raising worker
    would put every later reply out of step), the trainer closes the other's session, finish
    refuses, no version is committed (v21 stays); the rank restarts and v23 is bit-exact on
    the same workers. Paused mode: the live weights hold the part of v22 that landed (not
    v21). Shadow mode: nothing was switched, so the live weights are v21 bit for bit."""
    st = [dict(label="v21", seed=21), dict(label="v22", seed=22, die=1, check_seed=21),
          dict(label="v23", seed=23)]
    case = case_dict(tmp_path, "qwen3-kill", vc.QWEN3, MEGATRON_TP2, False, st, shadow,
                     timeout_s=30)
    procs = start(tmp_path, [case])
    try:
        assert procs.wait("trainer1", guard_s(60)) == 17
        procs.procs["trainer1-restarted"] = procs.procs.pop("trainer1")
        procs.spawn("trainer1", "vllm_trainer_worker.py", 1, {"cases": [case], "start": 2})
        procs.procs.pop("trainer1-restarted")
        finish(procs, guard_s(60))
    finally:
        procs.close()
    torn = procs.sent("qwen3-kill", "v22")
    assert torn["client_version"] == "v21" and torn["result"].startswith("TornUpdateError")
    assert torn["result"].count("did not reach every vLLM worker") == 1, torn["result"]
    for rank in range(2):
        c = procs.check("qwen3-kill", rank, "v22")
        assert c["weight_version"] == "v21"
        # worker 1 (read last) raised the update once and had no session left to finish
        assert c["raised"] == (["update_weights", "finish_weight_update"] if rank else []), \
            (rank, c["raised"])
        assert c["finish"].startswith("rdma_plan: vLLM worker") and "v21' stays" in c["finish"]
        if shadow:  # v21 kept serving, untouched; the transfer ran into the shadow only
            assert c["errors"] == [] and c["moved"] == [], c["errors"][:10]
            assert procs.during("qwen3-kill", rank, "v22")["errors"] == []
        else:
            assert c["errors"], "a torn update must leave some weights different from v21"
        c = procs.check("qwen3-kill", rank, "v23")
        assert c["errors"] == [] and c["moved"] == [] and c["weight_version"] == "v23"
        assert c["raised"] == [], c["raised"]
    assert procs.sent("qwen3-kill", "v23") == {"result": "ok", "client_version": "v23"}


def test_init_refusals_and_flashinfer_order() -> None:
    """`vllm_refusal_worker.py`: the FlashInfer-CUTLASS `w3w1` plan equals vLLM's own
    `convert_to_unquantized_kernel_format`; init refuses an MoE backend whose order differs
    from the plan's, a repacking backend, a worker of another TP size, a weight removed by
    post-load packing, MLA copies the plan does not refresh, and an unknown derived entry."""
    from tests.oracles.launch import launch

    launch("../integrations/vllm_refusal_worker.py", 1, {}, quiet_s=30.0)
