"""Swapped ranks and swapped plan parts are refused before anything is registered, on every
path: generic `executor.load`, the vLLM trainer path (`RdmaPlanTrainerEngine.trainer_init`,
real vLLM classes), the SGLang target (`SGLangTarget`), and, with real Megatron-Core and
FSDP2 processes, the adapters (`test_adapter_swaps_are_refused`).

"Before anything is registered": the loads get no rendezvous (a load past the checks
fails on that instead) or, in the processes, the job's store holds no lease or rank record
afterwards; the vLLM client is never asked to start the workers' load."""

from __future__ import annotations

import logging
import secrets
from types import SimpleNamespace

import pytest
import torch

import executor
from planner.compiler import compile_config
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.errors import IdentityError
from schemas.identity import describe
from schemas.plan import read_header
from schemas.plan_write import write_plan
from schemas.tensors import rank_tensors
from tests.support.integration import RecordingClient, module, state
from tests.support.models import qwen3
from tests.support.swap import swap_parts


def _plan(tmp_path, source: dict, target: dict, name: str = "p.rplan") -> str:
    spec = spec_from_hf(qwen3(num_hidden_layers=2))
    cfg = config_from_dict({"model": {"config": "x"}, "source": source, "target": target})
    validate(cfg, spec)
    path = str(tmp_path / name)
    write_plan(path, compile_config(cfg, spec))
    return path


def _ids(path: str) -> list[dict]:
    with open(path, "rb") as f:
        return list(read_header(f, path)[0].identities)


def _zeros(path: str, rank: int) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
            for t in rank_tensors(path, rank).tensors}


MEGA_TP2 = {"framework": "megatron", "tp": 2}
TRAINERS = [pytest.param("megatron", MEGA_TP2, id="megatron-tp2"),
            pytest.param("fsdp2", {"framework": "fsdp2", "dp": 2, "dtype": "float32"},
                         id="fsdp2-dp2")]
"""The two live trainers of the swapped-identity tests: Megatron-Core TP 2 and FSDP2 dp 2."""


def test_generic_load_without_identity_is_refused_unless_opted_out(tmp_path, caplog):
    path = _plan(tmp_path, MEGA_TP2, {"engine": "vllm", "tp": 1})
    ids = _ids(path)
    with pytest.raises(IdentityError) as e:
        executor.load(path, rank=1, tensors=_zeros(path, 1), transport="nixl")
    msg = str(e.value)
    assert "without identity=" in msg and describe(ids[1]) in msg and "no_identity=True" in msg
    # the opt-out passes the check (and then needs the rendezvous), with a warning
    with caplog.at_level(logging.WARNING, logger="executor"), \
            pytest.raises(ValueError, match="needs rendezvous"):
        executor.load(path, rank=1, tensors=_zeros(path, 1), transport="nixl",
                      no_identity=True, insecure=True)
    assert any("no_identity=True" in r.getMessage() for r in caplog.records)


def test_generic_swapped_parts_are_refused_naming_both(tmp_path):
    path = _plan(tmp_path, MEGA_TP2, {"engine": "vllm", "tp": 2})
    ids = _ids(path)
    for a, b in ((0, 1), (2, 3)):  # the two source (Megatron TP) and two target (vLLM TP) ranks
        swapped = swap_parts(path, a, b, str(tmp_path / f"swapped{a}.rplan"))
        for rank, other in ((a, b), (b, a)):
            with pytest.raises(IdentityError) as e:
                executor.load(swapped, rank=rank, tensors=_zeros(path, rank),
                              identity=ids[rank], transport="nixl")
            msg = str(e.value)
            assert f"the part of plan rank {rank} was compiled for {describe(ids[other])}" \
                in msg and f"the part of plan rank {other})" in msg, msg
            assert describe(ids[rank]) in msg and "\n" not in msg
    # the unswapped file passes both checks and stops at the missing rendezvous
    with pytest.raises(ValueError, match="needs rendezvous"):
        executor.load(path, rank=0, tensors=_zeros(path, 0), identity=ids[0], transport="nixl",
                      insecure=True)


def test_vllm_trainer_path_refuses_swaps_before_the_engine_loads(tmp_path, monkeypatch):
    base = pytest.importorskip("vllm.distributed.weight_transfer.base")
    ModuleSource = base.ModuleSource

    from integrations import megatron
    from integrations.vllm import RdmaPlanTrainerEngine, RdmaPlanTrainerInitInfo

    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    path = _plan(tmp_path, MEGA_TP2, {"engine": "vllm", "tp": 1})
    ids = _ids(path)
    tp1 = megatron.identity(state(tp=1, etp=1))  # this trainer process is Megatron TP rank 1
    assert tp1 == ids[1]
    source = ModuleSource(module(_zeros(path, 1)))

    def init(**kw) -> tuple[RecordingClient, str]:
        client = RecordingClient()
        info = RdmaPlanTrainerInitInfo(path if "plan" not in kw else kw.pop("plan"),
                                       "127.0.0.1:1", rank=0, **kw)
        with pytest.raises(IdentityError) as e:
            RdmaPlanTrainerEngine.trainer_init(info, client=client, source=source)
        assert client.calls == [], "the workers were asked to load"
        return client, str(e.value)

    # TP rank 1 started as trainer rank 0 (the launcher's order): plan rank 0 is TP 0
    _, msg = init(plan_rank=0, identity=tp1)
    assert describe(tp1) in msg and describe(ids[0]) in msg
    # no identity: refused unless opted out
    _, msg = init()
    assert "without identity=" in msg
    # the plan rank derived from the identity, but the file's parts swapped
    swapped = swap_parts(path, 0, 1, str(tmp_path / "swapped.rplan"))
    _, msg = init(plan=swapped, identity=tp1)
    assert "the part of plan rank 1 was compiled for" in msg and describe(ids[0]) in msg
    # with a job secret, an unsigned load needs allow_unsigned (or plan_key)
    monkeypatch.setenv("RDMA_PLAN_SECRET", secrets.token_hex(32))
    _, msg = init(identity=tp1)
    assert "a job secret is set but no plan_key" in msg and "allow_unsigned=True" in msg
    info = RdmaPlanTrainerInitInfo(path, "127.0.0.1:1", rank=1, identity=tp1)
    assert info.load_rank() == 1  # the rank follows the identity, not the trainer rank
    assert info.worker_info()["plan_key"] is None


def test_trainer_paths_take_the_adapters_binding_held_to_the_live_state(tmp_path,
                                                                        monkeypatch):
    """The vLLM trainer path and the SGLang trainer side (`load_source`) take the binding
    `integrations.megatron.bind` returns (here over a stand-in `parallel_state` of TP rank 1,
    which the binding reads again): the binding loads past every identity check; the same
    binding with the other rank's identity, a binding made by hand and a bare `identity=`
    (no live framework to hold them to) are refused in one line before the vLLM client is
    called or anything registered."""
    import dataclasses

    pytest.importorskip("vllm.distributed.weight_transfer.base")
    from integrations import Binding, megatron
    from integrations.sglang_trainer import load_source
    from integrations.vllm import RdmaPlanTrainerEngine, RdmaPlanTrainerInitInfo

    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    path = _plan(tmp_path, MEGA_TP2, {"engine": "vllm", "tp": 1})
    ids = _ids(path)
    b = megatron.bind(path, module(_zeros(path, 1)), parallel_state=state(tp=1, etp=1))
    assert (b.rank, b.identity) == (1, ids[1])
    swapped = dataclasses.replace(b, rank=0, identity=ids[0])
    by_hand = Binding(rank=1, identity=ids[1], tensors=b.tensors)

    def vllm(**kw) -> str:
        client = RecordingClient()
        info = RdmaPlanTrainerInitInfo(path, "127.0.0.1:1", rank=1, timeout_s=1, **kw)
        with pytest.raises(IdentityError) as e:
            RdmaPlanTrainerEngine.trainer_init(info, client=client)
        assert client.calls == [] and "\n" not in str(e.value)
        return str(e.value)

    def sglang(binding: Binding) -> str:
        with pytest.raises(IdentityError) as e:
            load_source(path, binding, rendezvous="127.0.0.1:1", timeout_s=1, insecure=True)
        return str(e.value)

    for msg in (vllm(binding=swapped), sglang(swapped)):
        assert f"handed plan rank 0 ({describe(ids[0])})" in msg, msg
        assert f"live framework state is {describe(ids[1])}, plan rank 1" in msg, msg
    msg = vllm(binding=b, identity=ids[0])
    assert describe(ids[0]) in msg and describe(ids[1]) in msg and "binding alone" in msg
    for msg in (vllm(binding=by_hand), sglang(by_hand), vllm(identity=ids[1])):
        assert "cannot be held to a live megatron" in msg and "binding=" in msg, msg
    # the binding passes every identity check and stops at the store nobody hosts
    for load in (lambda: RdmaPlanTrainerEngine.trainer_init(RdmaPlanTrainerInitInfo(
            path, "127.0.0.1:1", rank=1, timeout_s=1, binding=b), client=RecordingClient()),
                 lambda: load_source(path, b, rendezvous="127.0.0.1:1", timeout_s=1,
                                     insecure=True)):
        with pytest.raises(Exception) as e:
            load()
        assert not isinstance(e.value, IdentityError), e.value
    with pytest.raises(ValueError, match="leave the source out"):
        RdmaPlanTrainerEngine.trainer_init(RdmaPlanTrainerInitInfo(
            path, "127.0.0.1:1", rank=1, binding=b), client=RecordingClient(),
            source=base_source(b.tensors))


def base_source(tensors: dict[str, torch.Tensor]):  # noqa: ANN201 - a vLLM WeightSource
    from vllm.distributed.weight_transfer.base import ModuleSource

    return ModuleSource(module(tensors))


def test_sglang_target_refuses_swapped_parts_and_unsigned(tmp_path, monkeypatch):
    from integrations.sglang import SGLangTarget

    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    path = _plan(tmp_path, {"framework": "fsdp2", "dp": 1}, {"engine": "sglang", "tp": 2})
    ids = _ids(path)
    model = module(_zeros(path, 1))  # SGLang TP rank 0 = plan rank 1
    par = SimpleNamespace(tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, moe_ep_rank=0,
                          attn_dp_size=1)
    swapped = swap_parts(path, 1, 2, str(tmp_path / "swapped.rplan"))
    with pytest.raises(IdentityError) as e:
        SGLangTarget(model, swapped, updater=None, transport="nixl", parallel=par)
    msg = str(e.value)
    assert "the part of plan rank 1 was compiled for" in msg and describe(ids[2]) in msg
    monkeypatch.setenv("RDMA_PLAN_SECRET", secrets.token_hex(32))
    with pytest.raises(IdentityError, match="a job secret is set but no plan_key"):
        SGLangTarget(model, path, updater=None, transport="nixl", parallel=par)
    # signed with a key: plan_key passes the signing check (then needs the rendezvous)
    key = tmp_path / "plan.key"
    key.write_bytes(secrets.token_bytes(32))
    signed = str(tmp_path / "signed.rplan")
    spec = spec_from_hf(qwen3(num_hidden_layers=2))
    cfg = config_from_dict({"model": {"config": "x"}, "source": {"framework": "fsdp2", "dp": 1},
                            "target": {"engine": "sglang", "tp": 2}})
    write_plan(signed, compile_config(cfg, spec), key=key.read_bytes())
    with pytest.raises(ValueError, match="needs rendezvous"):
        SGLangTarget(model, signed, updater=None, transport="nixl", parallel=par,
                     plan_key=str(key))


@pytest.mark.oracle
@pytest.mark.extended
@pytest.mark.parametrize("role, source", TRAINERS)
def test_adapter_swaps_are_refused(tmp_path, role, source):
    """Real Megatron-Core (TP2 over gloo, CPU) and FSDP2 (`fully_shard`, dp 2) processes:
    each binds through its adapter (Megatron started with ETP=1 for a dense model, which the
    plan records as etp = tp rank), then tries the other rank's plan rank (with and without
    its identity) and its own rank of a file whose two source parts were swapped: every load
    is refused, naming both identities, and the job's store holds no lease or rank record."""
    pytest.importorskip("nixl")
    pytest.importorskip("megatron.core" if role == "megatron" else "transformers")
    from harness.launch import master_store
    from tests.support.integration import compile_plan, run_workers

    hf = qwen3(num_hidden_layers=2)
    config, plan = compile_plan(str(tmp_path), hf, source, {"engine": "vllm", "tp": 1})
    swapped = swap_parts(plan, 0, 1, str(tmp_path / "swapped.rplan"))
    ids = _ids(plan)
    store, port = master_store(60)
    base = {"plan": plan, "swapped": swapped, "config": config, "hf": hf, "swap": True,
            "swap_to": [1, 0], "store": f"127.0.0.1:{port}", "steps": 0, "sources": 2,
            "role": role, "float16_module": True,
            "etp": 1}  # Megatron started with ETP=1 for the dense model
    done = run_workers([{**base, "index": i} for i in range(2)])
    for i, f in enumerate(done):
        out = f.output
        assert f.returncode == 0, f"{role} {i} failed:\n{out[-4000:]}"
        lines = [ln for ln in out.splitlines() if ln.startswith("refused")]
        assert len(lines) == 3, out[-4000:]
        mine, other = describe(ids[i]), describe(ids[1 - i])
        assert mine in lines[0] and other in lines[0]  # this process vs the rank it took
        assert "without identity=" in lines[1]
        assert "was compiled for " + other in lines[2] and mine in lines[2]
    keys = [f"rplan/{k}/{r}" for k in ("lease", "rank") for r in range(3)]
    assert not any(store.check([k]) for k in keys), "a rank registered before the refusal"


@pytest.mark.oracle
@pytest.mark.extended
@pytest.mark.parametrize("role, source", TRAINERS)
def test_vllm_trainer_ranks_handed_each_others_identity_write_nothing(tmp_path, role, source):
    """Two live trainer ranks (real Megatron-Core TP2 over gloo, real FSDP2 `fully_shard`
    dp 2) on the vLLM trainer path (`RdmaPlanTrainerEngine.trainer_init`), each handed the
    other's identity as a launcher's bug would: as `identity=` beside its own tensors, as
    its adapter's binding with the identity and rank replaced, and beside its own binding.
    Every try is refused in one line naming the identity before the vLLM client is asked
    for anything, and the plan's target rank (a third process, its tensors zero, loading
    with the plan's store) is never written. Were a try accepted, its rank would send its
    own shard as the other's and the target would report the bytes written."""
    pytest.importorskip("nixl")
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    pytest.importorskip("megatron.core" if role == "megatron" else "transformers")
    from harness.launch import master_store
    from tests.oracles.launch import free_port
    from tests.support.integration import compile_plan, start_worker, worker_env

    hf = qwen3(num_hidden_layers=2)
    config, plan = compile_plan(str(tmp_path), hf, source, {"engine": "vllm", "tp": 1})
    ids = _ids(plan)
    store, port = master_store(60)
    base = {"plan": plan, "config": config, "hf": hf, "store": f"127.0.0.1:{port}",
            "steps": 0, "sources": 2, "float16_module": True,
            "etp": 1, "timeout_s": 300, "rendezvous": f"127.0.0.1:{free_port()}",
            "vllm_swap": [{"rank": 1, "identity": ids[1]}, {"rank": 0, "identity": ids[0]}]}
    env = worker_env(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    procs = [start_worker({**base, "role": r, "index": i}, env)
             for r, i in ((role, 0), (role, 1), ("target", 0))]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs[:2]]
        store.set("sources_done", "1")
        outs.append(procs[2].communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "target untouched: 0 of" in outs[2], (outs[2][-3000:], outs[0][-2000:])
    for i in range(2):
        assert procs[i].returncode == 0, f"{role} {i} failed:\n{outs[i][-4000:]}"
        lines = [ln for ln in outs[i].splitlines() if ln.startswith(("refused", "accepted"))]
        assert [ln.split(":")[0] for ln in lines] == [
            "refused identity=", "refused binding", "refused binding+identity="], outs[i][-3000:]
        mine, other = describe(ids[i]), describe(ids[1 - i])
        assert other in lines[0], lines[0]
        if role == "megatron":  # Megatron's parallel_state says who this process is
            assert f"plan rank {1 - i}" in lines[0] and f"plan rank {i}" in lines[0]
        else:  # an FSDP2 identity is read from the parameters' meshes: only a binding has them
            assert "pass binding=integrations.fsdp2.bind" in lines[0], lines[0]
        assert other in lines[1] and mine in lines[1] and f"plan rank {i}" in lines[1]
        assert other in lines[2] and mine in lines[2]
