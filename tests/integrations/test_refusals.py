"""The adapters refuse a model that disagrees with the plan, naming the key to change.

Models here are plain modules with the native names of a layout (no processes): the
Megatron adapter reads the coordinates from a stand-in `parallel_state` (the real one is
exercised by test_adapters.py)."""

from __future__ import annotations

import pytest
import torch

from harness.weights import DTYPES
from integrations import ModelMismatchError, fsdp2, megatron, trainer
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.chunked_plan import load_chunked, write_chunked
from schemas.config import SourceConfig
from schemas.config_load import config_from_dict
from schemas.errors import IdentityError
from schemas.plan_write import write_plan
from schemas.tensors import rank_tensors
from tests.support.integration import module, state
from tests.support.models import qwen3, qwen3_moe


def _plan(tmp_path, source: dict, layers: int = 4, hf=qwen3, budget: int = 0) -> str:
    """A plan for a vLLM TP 1 target; with `budget`, a chunked plan of that buffer."""
    spec = spec_from_hf(hf(num_hidden_layers=layers))
    target = {"engine": "vllm", "tp": 1, **({"shadow": {"budget_bytes": budget}}
                                           if budget else {})}
    cfg = config_from_dict({"model": {"config": "x"}, "source": source, "target": target})
    validate(cfg, spec)
    path = str(tmp_path / ("c.rplan" if budget else "p.rplan"))
    compiled = compile_config(cfg, spec)
    if budget:
        write_chunked(path, compiled, budget)
    else:
        write_plan(path, compiled)
    return path


def chunks(source: dict, rank: int, layers: int = 4, dtype: str | None = None,
           hf=qwen3) -> list:
    """The chunks of a Megatron rank as our layout names them (zeros)."""
    cfg = SourceConfig(**source)
    lay = build_layout(spec_from_hf(hf(num_hidden_layers=layers)), cfg).ranks[rank]
    per: dict[int, dict[str, torch.Tensor]] = {}
    for t in lay.tensors:
        v, name = (int(t.name[5]), t.name[7:]) if cfg.vpp > 1 else (0, t.name)
        per.setdefault(v, {})[name] = torch.zeros(t.shape, dtype=DTYPES[dtype or t.dtype])
    return [module(per[v]) for v in sorted(per)]


MEGA = {"framework": "megatron", "tp": 2, "pp": 2, "vpp": 2}


def test_megatron_binds_the_live_storage(tmp_path):
    path = _plan(tmp_path, MEGA)
    model = chunks(MEGA, 3)
    b = megatron.bind(path, model, state(tp=1, pp=1, etp=1, vpp=2))
    assert b.rank == 3 and b.identity["tp"] == 1 and b.identity["vpp"] == 2
    live = dict(model[1].named_parameters())
    assert b.tensors["model1.decoder.final_layernorm.weight"].data_ptr() == \
        live["decoder.final_layernorm.weight"].data_ptr()
    wrapped = [torch.nn.Module() for _ in model]  # DDP / Float16Module keep it in .module
    for w, m in zip(wrapped, model):
        w.add_module("module", m)
    assert megatron.bind(path, wrapped, state(tp=1, pp=1, etp=1, vpp=2)).rank == 3


@pytest.mark.parametrize("plan_source, model_source, rank, message", [
    (dict(MEGA, transformer_engine=True), MEGA, 0, "set source.transformer_engine: false"),
    (MEGA, dict(MEGA, transformer_engine=True), 0, "set source.transformer_engine: true"),
    # the plan puts 2 layers on stage 0 (1 per chunk), the model was built with 4 and 4
    (dict(MEGA, pp_first_stage_layers=2), MEGA, 0, "pp_first_stage_layers"),
    (dict(MEGA, dtype="float32"), MEGA, 0, "dtype bfloat16, the plan has float32"),
])
def test_megatron_mismatches_are_named(tmp_path, plan_source, model_source, rank, message):
    uneven = "pp_first_stage_layers" in plan_source
    path = _plan(tmp_path, dict(plan_source, framework="megatron"), layers=6 if uneven else 4)
    # uneven: the plan has 6 layers, 1 per chunk on stage 0; the model 8, 2 per chunk
    model = chunks(dict(model_source, framework="megatron"), rank, layers=8 if uneven else 4)
    with pytest.raises(ModelMismatchError) as e:
        megatron.bind(path, model, state(vpp=2))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("plan_layout, model_layout", [("grouped", "sequential"),
                                                       ("sequential", "grouped")])
def test_megatron_expert_layout_is_named(tmp_path, plan_layout, model_layout):
    source = {"framework": "megatron", "ep": 2, "dp": 2}
    path = _plan(tmp_path, dict(source, expert_layout=plan_layout), hf=qwen3_moe)
    model = chunks(dict(source, expert_layout=model_layout), 1, hf=qwen3_moe)
    with pytest.raises(ModelMismatchError, match=f"set source.expert_layout: {model_layout}"):
        megatron.bind(path, model[0], state(dp=1, ep=1))


def test_megatron_wrong_chunks_or_identity(tmp_path):
    path = _plan(tmp_path, MEGA)
    with pytest.raises(ModelMismatchError, match="1 model chunk"):
        megatron.bind(path, chunks(MEGA, 0)[:1], state(vpp=2))
    with pytest.raises(IdentityError, match="no source rank has the identity megatron tp=0 "
                       "pp=0 vpp=1"):
        megatron.bind(path, chunks(MEGA, 0)[0], state(vpp=None))


def test_a_chunked_plan_binds_what_the_plan_does_and_refuses_another_identity(tmp_path):
    # the same job compiled as a plan and as a chunked plan (several chunks): each adapter
    # binds the same rank, identity and tensor storage from both; on the chunked plan an
    # identity it does not hold is refused in one line, as on the plan
    plain, chunked = _plan(tmp_path, MEGA), _plan(tmp_path, MEGA, budget=8 << 10)
    assert len(load_chunked(chunked)[1]) > 1
    for rank in range(4):
        tp, pp = rank % 2, rank // 2
        model = chunks(MEGA, rank)
        a = megatron.bind(plain, model, state(tp=tp, pp=pp, vpp=2))
        b = megatron.bind(chunked, model, state(tp=tp, pp=pp, vpp=2))
        assert (b.rank, b.identity) == (a.rank, a.identity) == (rank, b.identity)
        assert list(b.tensors) == list(a.tensors)
        assert all(b.tensors[n].data_ptr() == t.data_ptr() for n, t in a.tensors.items())
    with pytest.raises(IdentityError, match=r"^[^\n]*no source rank has the identity megatron "
                       r"tp=0 pp=0 vpp=1[^\n]*$"):
        megatron.bind(chunked, chunks(MEGA, 0)[0], state(vpp=None))
    # the trainer path: `identity=` finds its rank in the chunked plan; rank 0's part of
    # every chunk is refused for rank 1's identity, naming chunk 0, before any load
    ident = rank_tensors(chunked, 1).identity
    assert trainer.plan_rank(chunked, None, ident, None, 0, "trainer") == (1, ident)
    with pytest.raises(IdentityError, match=r"^[^\n]*c\.rplan chunk 0[^\n]*$"):
        trainer.checked_parts(chunked, 0, ident, False, None, None, "trainer")
    source = {"framework": "fsdp2", "dtype": "float32"}
    plain, chunked = _plan(tmp_path, source), _plan(tmp_path, source, budget=8 << 10)
    lay = build_layout(spec_from_hf(qwen3(num_hidden_layers=4)), SourceConfig(**source))
    model = module({t.name: torch.zeros(t.shape) for t in lay.ranks[0].tensors})
    a, b = fsdp2.bind(plain, model), fsdp2.bind(chunked, model)
    assert (b.rank, b.identity, list(b.tensors)) == (a.rank, a.identity, list(a.tensors))
    # a target's tensors are split over the chunks: their union is the plan's
    whole, split = rank_tensors(plain, 1), rank_tensors(chunked, 1)
    assert sorted((t.name, t.shape, t.dtype) for t in split.tensors) == \
        sorted((t.name, t.shape, t.dtype) for t in whole.tensors)
    assert split.identity == whole.identity


def test_fsdp2_plain_module_and_dtype(tmp_path):
    source = {"framework": "fsdp2", "dtype": "float32"}
    path = _plan(tmp_path, source)
    lay = build_layout(spec_from_hf(qwen3(num_hidden_layers=4)), SourceConfig(**source))
    model = module({t.name: torch.zeros(t.shape) for t in lay.ranks[0].tensors})
    b = fsdp2.bind(path, model)  # no DTensors: the 1-rank mesh (0, 0, 0)
    assert b.rank == 0 and b.identity == {"framework": "fsdp2", "dp_replicate": 0,
                                          "dp_shard": 0, "tp": 0}
    model = module({t.name: torch.zeros(t.shape, dtype=torch.bfloat16)
                    for t in lay.ranks[0].tensors})
    with pytest.raises(ModelMismatchError, match="compile with source.dtype: bfloat16"):
        fsdp2.bind(path, model)


def test_megatron_dense_model_with_etp1_binds(tmp_path):
    # Megatron run with expert_tensor_parallel_size=1 on a dense model reports
    # etp=0 on every TP rank; the plan records etp = the TP rank. No expert tensor: bound.
    path = _plan(tmp_path, {"framework": "megatron", "tp": 2})
    b = megatron.bind(path, chunks({"framework": "megatron", "tp": 2}, 1), state(tp=1, etp=0))
    assert b.rank == 1 and b.identity["etp"] == 1 and b.identity["tp"] == 1
    # with experts the expert coordinates decide: still refused, naming the config
    moe = {"framework": "megatron", "tp": 2, "expert_layout": "sequential"}
    path = _plan(tmp_path, moe, hf=qwen3_moe)
    with pytest.raises(IdentityError, match="no source rank has the identity"):
        megatron.bind(path, chunks(moe, 1, hf=qwen3_moe), state(tp=1, etp=0))


def test_megatron_mixed_precision_dtype_hint(tmp_path):
    # fp32 norms beside bf16 linears (mixed precision without Float16Module) were
    # told "compile with source.dtype: float32, or pass the bfloat16 tensors" for each norm,
    # and recompiling for float32 then refuses every linear. One dtype must be bound.
    path = _plan(tmp_path, {"framework": "megatron"})
    model = chunks({"framework": "megatron"}, 0)
    for name, p in model[0].named_parameters():
        if "norm" in name:
            p.data = p.data.float()
    with pytest.raises(ModelMismatchError) as e:
        megatron.bind(path, model, state())
    msg = str(e.value)
    assert "the model mixes dtypes (" in msg and "float32" in msg and "bfloat16" in msg
    assert "compile with source.dtype: float32" not in msg
    assert "Float16Module" in msg and "\n" not in msg
