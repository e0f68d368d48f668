"""The post-refit content check (`integrations/vllm_content.py`) on vLLM's own code: the
scale buffers and host copies made by vLLM's `set_default_quant_scales`, and MLA's
`W_UK_T`/`W_UV` made by vLLM's `split_kv_b_proj` from a `kv_b_proj`. Each case is one a
shape/dtype check passes."""

from __future__ import annotations

import pytest
import torch

from integrations import vllm_content as content

attention = pytest.importorskip("vllm.model_executor.layers.attention.attention")
mla_attention = pytest.importorskip("vllm.model_executor.layers.attention.mla_attention")

L, N, P, V = 16, 2, 8, 4  # kv_lora_rank, heads, qk_nope_head_dim, v_head_dim


def _attn() -> torch.nn.Module:
    layer = torch.nn.Module()
    attention.set_default_quant_scales(layer, register_buffer=True)
    return layer


def _mla() -> torch.nn.Module:
    m = torch.nn.Module()
    m.kv_b_proj = torch.nn.Linear(L, N * (P + V), bias=False, dtype=torch.bfloat16)
    m.kv_b_proj.quant_method = None
    m.kv_lora_rank, m.num_heads, m.qk_nope_head_dim, m.v_head_dim = L, N, P, V
    uk, uv = mla_attention.split_kv_b_proj(m.kv_b_proj, torch.bfloat16, L, N, P, V)
    m.W_UK_T = uk.permute(1, 2, 0).contiguous()
    m.W_UV = uv.transpose(0, 1).contiguous()
    return m


def test_host_scale_copies_are_checked_and_refreshed_in_place():
    model = torch.nn.Module()
    model.attn = _attn()
    assert content.check(model, {}, {}, torch.bfloat16) == []
    ptr = model.attn._k_scale_cpu.data_ptr()
    with torch.no_grad():
        model.attn._k_scale.fill_(0.5)  # the plan writes the device scale
    wrong = content.check(model, {}, {}, torch.bfloat16)
    assert len(wrong) == 1 and wrong[0].startswith("attn._k_scale_cpu: host copy 1.0")
    assert content.refresh_host_scales(model) == 2
    assert content.check(model, {}, {}, torch.bfloat16) == []
    assert model.attn._k_scale_cpu.data_ptr() == ptr and model.attn._k_scale_float == 0.5
    assert set(content.host_pointers(model)) == {"attn._k_scale_cpu", "attn._v_scale_cpu"}
    # vLLM's post-load processing makes a new host copy (kv_cache.py: `.to("cpu")`): its
    # value goes back into the storage kept at init, which is put back
    kept = content.keep_host_scales(model)
    with torch.no_grad():
        model.attn._k_scale.fill_(0.25)
    model.attn._k_scale_cpu = model.attn._k_scale.detach().to("cpu", copy=True)
    assert content.restore_host_scales(kept) == 1
    assert model.attn._k_scale_cpu.data_ptr() == ptr and model.attn._k_scale_cpu.item() == 0.25


def test_mla_derived_tensors_are_recomputed_from_the_written_kv_b_proj():
    m = _mla()
    mla = {"layers.0.self_attn": m}
    before = content.mla_inputs(mla, ["layers.0.self_attn"])
    assert content.check(m, mla, before, torch.bfloat16) == []
    with torch.no_grad():  # a raw write of new weights, no refresh: same shapes, stale copies
        m.kv_b_proj.weight.add_(1)
    before = content.mla_inputs(mla, ["layers.0.self_attn"])
    wrong = content.check(m, mla, before, torch.bfloat16)
    assert [w.split(":")[0] for w in wrong] == ["layers.0.self_attn.W_UK_T",
                                                "layers.0.self_attn.W_UV"]
    # a refresh that re-lays kv_b_proj out in place (same shape): its checksum moved
    with torch.no_grad():
        w = m.kv_b_proj.weight
        w.copy_(w.reshape(-1).flip(0).reshape(w.shape))
    wrong = content.check(m, mla, before, torch.bfloat16)
    assert len(wrong) == 1 and "changed during the refresh" in wrong[0]


def test_checksum_sees_a_permutation():
    x = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    assert content.checksum(x) == content.checksum(x.clone())
    assert content.checksum(x) != content.checksum(x.t().contiguous())
