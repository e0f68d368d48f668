"""One vLLM 0.33 process (TP 1, CPU): the init-time checks of `rdma_plan` on real models,
and the FlashInfer-CUTLASS `w13` order against vLLM's own conversion function.

Each check prints `ok <name>`; any failure raises (exit 1). The engine's checks are run on
real vLLM models; where a GPU backend would differ (the MoE backend chosen, a weight that a
CPU/AMX GEMM packing removes, MLA W_UK_T/W_UV stored as copies by the AITER BMM paths), the
model is put in that state the way vLLM's own code does it (the attribute vLLM selects, an
empty `Parameter`, a new `Parameter`), then the engine's check must refuse, naming the layer
and the backend.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from tests.integrations import vllm_cases as vc  # noqa: E402
from tests.integrations.vllm_engine_worker import engine_config  # noqa: E402
from tests.support.vllm_cpu_build import KEEP, init_distributed, patch_cpu  # noqa: E402


def refused(fn, *args, match: tuple[str, ...]) -> str:  # noqa: ANN001
    from integrations.errors import EngineMismatchError

    try:
        fn(*args)
    except EngineMismatchError as e:
        missing = [m for m in match if m not in str(e)]
        assert not missing, f"{e} does not name {missing}"
        assert "\n" not in str(e)
        return str(e)
    raise AssertionError(f"{fn.__name__} accepted what it must refuse")


def header(hf: dict, **target):  # noqa: ANN201 - a PlanHeader
    from schemas.config import TargetConfig
    from schemas.header import ModelInfo, PlanHeader

    t = TargetConfig("vllm", **target)
    return PlanHeader(target=t, sources=1, world=1 + t.tp * t.dp * t.pp,
                      model=ModelInfo(vocab=hf["vocab_size"]))


def build(cfg, hf: dict):  # noqa: ANN001, ANN201
    from vllm.model_executor.model_loader import get_model

    model = get_model(vllm_config=cfg)
    KEEP.append(model)
    model.load_weights(iter(vc.full_tensors(hf, 3).items()))
    return cfg, model


def moe_checks(cfg) -> None:  # noqa: ANN001
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        convert_to_unquantized_kernel_format,
    )

    from harness.weights import materialize
    from integrations import vllm_checks as checks
    from planner.layouts import vllm as layout
    from planner.spec import spec_from_hf
    from schemas.config import TargetConfig

    hf = vc.QWEN3_MOE
    _, model = build(cfg, hf)
    ident = {"framework": "vllm", "index": 0, "dp": 0, "tp": 0, "pp": 0}
    name, layer = checks.moe_layers(model)[0]
    # FlashInfer-CUTLASS: vLLM's conversion of the loaded w13 == our plan's w3w1 order
    converted, _ = convert_to_unquantized_kernel_format(
        UnquantizedMoeBackend.FLASHINFER_CUTLASS, layer.moe_config,
        layer.w13_weight.data.clone(), layer.w2_weight.data.clone())
    spec, full = spec_from_hf(hf, mtp=False), vc.full_tensors(hf, 3)
    ours = {o: materialize(layout.layout(spec, TargetConfig("vllm", dtype="bfloat16",
                                                            w13_order=o)), full)[0]
            for o in ("w1w3", "w3w1")}
    w13 = name + ".w13_weight"
    assert torch.equal(ours["w1w3"][w13], layer.w13_weight.data)
    assert torch.equal(ours["w3w1"][w13], converted)
    assert not torch.equal(converted, layer.w13_weight.data)
    print("ok flashinfer_cutlass order", flush=True)
    # backends: CPU without vLLM's _C keeps the loader order; FlashInfer needs w3w1
    assert checks.check_experts(model, header(hf), ident) == 0
    qm = layer.quant_method
    qm.unquantized_backend = UnquantizedMoeBackend.FLASHINFER_CUTLASS
    print(refused(checks.check_experts, model, header(hf), ident,
                  match=(name, "FLASHINFER_CUTLASS", "w13_order: w3w1")), flush=True)
    for other in checks.moe_layers(model)[1:]:
        other[1].quant_method.unquantized_backend = UnquantizedMoeBackend.FLASHINFER_CUTLASS
    assert checks.check_experts(model, header(hf, w13_order="w3w1"), ident) == 0
    qm.unquantized_backend = UnquantizedMoeBackend.AITER
    print(refused(checks.check_experts, model, header(hf, w13_order="w3w1"), ident,
                  match=(name, "AITER", "repacked")), flush=True)
    # identity: the plan was compiled for TP 2
    print(refused(checks.find_plan_rank, header(hf, tp=2), {**ident, "ep": 0,
                  "tp_size": 1, "pp_size": 1}, match=("tp_size 1 (plan 2)",)), flush=True)
    print("ok moe refusals", flush=True)


def dense_checks(cfg) -> None:  # noqa: ANN001
    from integrations import vllm_checks as checks
    from integrations.vllm_content import live_tensors
    from schemas.plan import Region

    hf = DENSE_MLA
    cfg, model = build(cfg, hf)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    mla = checks.mla_modules(model)
    assert sorted(mla) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert checks.refreshers(model, [], torch.bfloat16) == []  # bf16: views of kv_b_proj
    # a weight removed by post-load packing (vLLM's CPU GEMM dispatch with remove_weight)
    proj = model.get_submodule("model.layers.1.self_attn.o_proj")
    regions = [Region(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                      t.numel() * t.element_size()) for n, t in live_tensors(model).items()]
    proj.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    print(refused(checks.check_tensors, model, regions, live_tensors(model),
                  match=("model.layers.1.self_attn.o_proj (UnquantizedLinearMethod)",)),
          flush=True)
    # MLA W_UK_T/W_UV turned into copies (what vLLM's AITER fp8/fp4 BMM paths store)
    m = mla["model.layers.0.self_attn"]
    m.W_UK_T = torch.nn.Parameter(m.W_UK_T.detach().clone(), requires_grad=False)
    print(refused(checks.refreshers, model, [], torch.bfloat16,
                  match=("model.layers.0.self_attn", type(m.impl).__name__, "copies")),
          flush=True)
    entry = {"rule": "mla_absorb", "engine": "vllm", "module": "model.layers.0.self_attn",
             "reads": [], "writes": ["W_UK_T", "W_UV"]}
    assert len(checks.refreshers(model, [entry], torch.bfloat16)) == 1
    unknown = {**entry, "module": "model.layers.9.self_attn"}
    print(refused(checks.refreshers, model, [entry, unknown], torch.bfloat16,
                  match=("model.layers.9.self_attn",)), flush=True)
    print("ok dense refusals", flush=True)


DENSE_MLA = vc.DEEPSEEK | dict(first_k_dense_replace=2)


def plugin_checks() -> None:
    """pyproject's `vllm.general_plugins` entry point, installed as package metadata in a
    temporary folder, registers both engines through vLLM's own plugin loader."""
    import tempfile

    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    from integrations.vllm import BACKEND, register

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "pyproject.toml")) as f:  # the section's `k = "v"` lines
        section = f.read().split('[project.entry-points."vllm.general_plugins"]')[1]
    eps = dict(line.replace('"', "").split(" = ") for line in
               section.split("\n\n")[0].strip().splitlines())
    assert eps == {"rdma_plan": "integrations.vllm:register"}, eps
    site = tempfile.mkdtemp(prefix="rplan-plugin-")
    info = os.path.join(site, "rdma_plan_test-0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: rdma-plan-test\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    sys.path.insert(0, site)
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        assert BACKEND not in factory._registry
    load_general_plugins()
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        assert BACKEND in factory._registry, factory
    register()  # again: idempotent (vLLM's registry raises on duplicates)
    assert WeightTransferEngineFactory._registry[BACKEND]().__name__ == \
        "RdmaPlanWeightTransferEngine"
    print("ok plugin entry point", flush=True)


def main() -> None:
    arg = json.loads(sys.argv[1])
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, initialize_model_parallel

    patch_cpu()
    plugin_checks()
    init_distributed(1, 0, arg["port"])
    for check, hf in ((moe_checks, vc.QWEN3_MOE), (dense_checks, DENSE_MLA)):
        cfg = engine_config(dict(name="x", hf=hf, tp=1, ep=False), 0)
        with set_current_vllm_config(cfg):
            initialize_model_parallel(tensor_model_parallel_size=1)
            try:
                check(cfg)
            finally:
                destroy_model_parallel()


if __name__ == "__main__":
    main()
