"""The model spec against transformers (the HF model on the meta device), and the CLI totals.

For every config.json in plans/models/ we build the HF model with transformers on the meta
device (no weights, no download) and compare its state_dict with our spec: the same names
and shapes. transformers 5.x fuses experts (`mlp.experts.gate_up_proj [E, 2I, H]`, gate
half first, and `down_proj [E, H, I]`); transformers' own `revert_weight_conversion` (what
`save_pretrained` runs, used by `planner.models.hf`) splits them back into checkpoint names.
A tied `lm_head` is in the HF state_dict but not in our spec (written once). DeepSeek-V3's
MTP layer is in checkpoints but not in the HF model, so it is compared with HF's own MoE
layer. All models are compared at full size (the meta device makes that ~0.1 s each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.spec import ModelSpec, load_spec, spec_from_hf

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted(p.parent.name for p in (ROOT / "plans" / "models").glob("*/config.json"))

# Published parameter counts (HF model, MTP excluded, tied embeddings counted once).
PUBLISHED_B = {
    "qwen3-4b": 4.02, "qwen3-8b": 8.19, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1,
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "deepseek-v3": 671.0, "kimi-k2": 1026.4,
    "mixtral-8x7b": 46.7, "gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83,
    "gemma-3-1b": 0.999886,  # 999,885,952 (Keras Hub's gemma3_1b preset metadata)
}
# Checkpoint totals (MTP layers included), as the Hub counts a checkpoint's safetensors:
# GLM-4.5 is announced as 355B / GLM-4.5-Air as 106B total, rounded figures that the HF
# model (352.8B / 106.85B, MTP excluded) does not reach; their checkpoints hold 358B / 110B.
PUBLISHED_CHECKPOINT_B = {"glm-4.5": 358.0, "glm-4.5-air": 110.0}


def _hf_config(name: str) -> dict:
    return json.loads((ROOT / "plans" / "models" / name / "config.json").read_text())


def _hf_state(hf: dict) -> tuple[dict[str, tuple[tuple[int, ...], str]], object]:
    """name -> (shape, dtype) of the transformers model built on the meta device, fused
    experts reverted to checkpoint names by transformers' own `revert_weight_conversion`
    (`planner.models.hf`, the spec of families without a hand-written module)."""
    pytest.importorskip("transformers")
    from planner.models import hf as from_transformers

    state = from_transformers.state(hf, hf.get("torch_dtype", "bfloat16"))
    return ({k: (shape, dt) for k, (shape, dt, _) in state.items()},
            from_transformers.config(hf))


def _ours(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.checkpoint_shape, t.dtype) for t in spec.tensors if not t.mtp}


@pytest.mark.parametrize("name", MODELS)
def test_spec_matches_transformers(name: str) -> None:
    hf = _hf_config(name)
    theirs, cfg = _hf_state(hf)
    spec = spec_from_hf(hf)
    ours = _ours(spec)
    if cfg.tie_word_embeddings:
        assert theirs.pop("lm_head.weight")[0] == ours["model.embed_tokens.weight"][0]
        assert spec.dims.tied
    assert sorted(set(theirs) - set(ours)) == [], "in transformers, missing from our spec"
    assert sorted(set(ours) - set(theirs)) == [], "in our spec, not in transformers"
    wrong = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert wrong == {}, "(ours, transformers) differ"
    # ModelDims.moe_layers agrees with the layers where transformers built experts.
    experts = f".{spec.dims.moe_module}.experts."
    hf_moe = {int(k.split(".")[2]) for k in theirs if experts in k}
    assert {i for i in range(spec.dims.num_layers) if spec.dims.is_moe(i)} == hf_moe


# Variants of the tiny models that take other branches of the families.
VARIANTS = {
    "qwen2 (qkv bias, no qk norm)": ("tiny-qwen3", {"model_type": "qwen2"}),
    "llama tied, no head_dim key": ("tiny-qwen3", {"model_type": "llama", "head_dim": None,
                                                   "tie_word_embeddings": True}),
    "qwen3_moe sparse step 2 + mlp_only": ("tiny-qwen3-moe", {"decoder_sparse_step": 2,
                                                              "mlp_only_layers": [3]}),
    "deepseek_v3 no q_lora, no dense layer": ("tiny-deepseek-v3", {"q_lora_rank": None,
                                                                   "first_k_dense_replace": 0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_spec_variants_match_transformers(variant: str) -> None:
    base, changes = VARIANTS[variant]
    hf = {**_hf_config(base), **changes}
    theirs, cfg = _hf_state(hf)
    spec = spec_from_hf(hf)
    ours = _ours(spec)
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert ours == theirs


def test_spec_order_is_checkpoint_order() -> None:
    """embed_tokens first, layers in increasing order, norm and lm_head last."""
    spec = load_spec(str(ROOT / "plans/models/qwen3-8b"))
    names = [t.name for t in spec.tensors]
    assert names[0] == "model.embed_tokens.weight"
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [t.layer for t in spec.tensors if t.layer >= 0]
    assert layers == sorted(layers) and layers[-1] == 35


@pytest.mark.parametrize("name", ["deepseek-v3", "tiny-deepseek-v3", "glm-4.5-air",
                                  "tiny-glm4-moe"])
def test_mtp_layer_is_a_moe_layer_plus_its_heads(name: str) -> None:
    """The MTP layer L (checkpoint only) = HF's MoE decoder layer + embed/enorm/hnorm/eh_proj/
    shared_head, each shaped like the HF tensor it mirrors."""
    hf = _hf_config(name)
    theirs, _ = _hf_state(hf)
    spec = spec_from_hf(hf)
    n = spec.dims.num_layers
    assert spec.dims.mtp_layers == hf["num_nextn_predict_layers"] == 1
    assert spec.dims.is_moe(n)  # the MTP layer has experts
    mtp = {t.name: (t.shape, t.dtype) for t in spec.tensors if t.mtp}
    last = f"model.layers.{n - 1}."  # the last HF layer is a MoE layer
    h = hf["hidden_size"]
    extras = {"embed_tokens.weight": theirs["model.embed_tokens.weight"],
              "shared_head.head.weight": theirs["lm_head.weight"],
              "shared_head.norm.weight": theirs["model.norm.weight"],
              "enorm.weight": theirs["model.norm.weight"],
              "hnorm.weight": theirs["model.norm.weight"],
              "eh_proj.weight": ((h, 2 * h), theirs["lm_head.weight"][1])}
    expected = {k.replace(last, f"model.layers.{n}."): v for k, v in theirs.items()
                if k.startswith(last)}
    expected.update({f"model.layers.{n}.{k}": v for k, v in extras.items()})
    assert mtp == expected
    assert spec.mtp_params == sum(_numel(s) for s, _ in expected.values())
    assert spec_from_hf(hf, mtp=False).mtp_params == 0


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_cli_spec_totals_match_published(name: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["spec", str(ROOT / "plans/models" / name), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Published figures are rounded (30.5B for 30.53B): allow half a unit of their last
    # digit, or 0.1%, whichever is larger.
    published = PUBLISHED_B[name]
    half_unit = 0.5 * 10 ** -len(str(published).split(".")[1])
    assert out["total_params"] / 1e9 == pytest.approx(published, abs=max(half_unit,
                                                                         1e-3 * published))
    assert out["total_params"] == sum(_numel(t["shape"]) for t in out["tensors"]
                                      if not t["mtp"])


@pytest.mark.parametrize("name", sorted(PUBLISHED_CHECKPOINT_B))
def test_checkpoint_totals_match_published(name: str) -> None:
    spec = load_spec(str(ROOT / "plans/models" / name))
    published = PUBLISHED_CHECKPOINT_B[name]
    total = (spec.total_params + spec.mtp_params) / 1e9
    assert total == pytest.approx(published, abs=max(0.5, 1e-3 * published))


def test_cli_spec_subprocess_and_num_layers() -> None:
    """`python -m planner spec DIR --json --num-layers 2` in a fresh process."""
    run = subprocess.run([sys.executable, "-m", "planner", "spec",
                          str(ROOT / "plans/models/tiny-deepseek-v3"), "--json",
                          "--num-layers", "2"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    layers = {int(t["name"].split(".")[2]) for t in out["tensors"]
              if t["name"].startswith("model.layers.")}
    assert layers == {0, 1, 2}  # 2 layers + the MTP layer after them
    assert out["mtp_params"] > 0
    assert {"name", "shape", "dtype"} <= set(out["tensors"][0])


def test_cli_spec_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["spec", str(ROOT / "plans/models/tiny-qwen3/config.json")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.3.self_attn.k_proj.weight" in out and "64x256" in out
    rows = [line for line in out.splitlines() if line.startswith(("model.", "lm_head."))]
    assert len(rows) == 47  # embed, 4 layers x 11, norm, lm_head (untied)
