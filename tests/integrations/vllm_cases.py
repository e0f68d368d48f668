"""Shared by the vLLM weight-transfer test and its processes: models, checkpoints, the
store RPC that stands in for vLLM's engine-side control plane (`collective_rpc` to every
worker, as `LLM`/`AsyncLLM` do), and the source tensors each trainer rank holds."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch

BASE = dict(hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_theta=10000.0, torch_dtype="bfloat16", num_hidden_layers=2)
QWEN3 = BASE | dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=128,
                    vocab_size=1100, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=256, tie_word_embeddings=False)
QWEN3_MOE = BASE | dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                        hidden_size=128, vocab_size=1100, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, intermediate_size=192,
                        moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                        tie_word_embeddings=False)
MLA = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
           n_shared_experts=1, num_experts_per_tok=2, moe_layer_freq=1, n_group=1,
           topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
           routed_scaling_factor=1.0, num_nextn_predict_layers=0, tie_word_embeddings=False,
           rope_scaling=None)
DEEPSEEK = BASE | MLA | dict(hidden_size=128, vocab_size=1100, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                             intermediate_size=192, moe_intermediate_size=48,
                             n_routed_experts=8, first_k_dense_replace=1)
FP8_BLOCK = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                 weight_block_size=[128, 128])
# DeepSeek-V3-shaped, block-FP8, dense layers only (FP8 MoE kernels are refused at init):
# kv_b_proj [4 heads * (128 + 128), 128] per TP-2 rank is 2 x 1 blocks.
DEEPSEEK_FP8 = BASE | MLA | dict(hidden_size=256, vocab_size=300, num_attention_heads=4,
                                 num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
                                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                 intermediate_size=256, moe_intermediate_size=256,
                                 n_routed_experts=4, first_k_dense_replace=2,
                                 quantization_config=FP8_BLOCK)


def full_tensors(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """The HF checkpoint (bf16) of version `seed`."""
    from harness.weights import random_full_tensors
    from planner.spec import spec_from_hf

    return random_full_tensors(spec_from_hf(hf, mtp=False), seed=seed)


def checkpoint(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """What vLLM loads for version `seed`: bf16, or block-FP8 (`weight` e4m3 +
    `weight_scale_inv`) where the config says so."""
    from harness.weights import quantize_full
    from planner.spec import spec_from_hf

    full = full_tensors(hf, seed)
    if "quantization_config" in hf:
        return quantize_full(spec_from_hf(hf, mtp=False), full)
    return full


def plan_config(hf: dict, source: dict, tp: int, ep: bool, folder: str,
                budget: int | None = None) -> Any:
    """The case's config; `budget`: a chunked plan of that buffer (`target.shadow`)."""
    from schemas.config_load import config_from_dict

    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    dtype = "fp8_block128" if "quantization_config" in hf else "bfloat16"
    target = {"engine": "vllm", "tp": tp, "ep": ep, "dtype": dtype}
    if budget is not None:
        target["shadow"] = {"budget_bytes": budget}
    return config_from_dict({"model": {"config": "config.json"}, "source": source,
                             "target": target}, folder)


def source_tensors(case: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Trainer rank `rank`'s tensors of version `seed` (the plan's source layout)."""
    from harness.weights import materialize
    from planner.frameworks import build_layout
    from planner.spec import spec_from_hf
    from schemas.config import SourceConfig

    layout = build_layout(spec_from_hf(case["hf"], mtp=False), SourceConfig(**case["source"]))
    return materialize(layout, full_tensors(case["hf"], seed), ranks=[rank])[rank]


def open_control(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=300))


class StoreClient:
    """A `VLLMWeightSyncClient` over the test's store: each call runs on every worker and
    reads the replies as vLLM's `MultiprocExecutor.collective_rpc` does: one queue per
    worker, in rank order, stopping at the first failed reply (the later workers' replies of
    that call stay queued and are what the next call reads from them: a failure raised by
    several workers puts the engine's replies out of step). `finish_weight_update` sets the
    version only when every worker finished (as `LLM.finish_weight_update` does)."""

    def __init__(self, store: Any, case: str, workers: int) -> None:
        self.store, self.case, self.workers, self.seq = store, case, workers, 0
        self.read = [0] * workers  # the next reply each worker's queue gives
        self.weight_version: str | None = None

    def call(self, method: str, **kwargs: Any) -> None:
        seq, self.seq = self.seq, self.seq + 1
        msg = json.dumps({"method": method, "kwargs": kwargs})
        for w in range(self.workers):
            self.store.set(f"{self.case}/rpc/{w}/{seq}", msg)
        for w in range(self.workers):
            reply = json.loads(self.store.get(f"{self.case}/reply/{w}/{self.read[w]}"))
            self.read[w] += 1
            if reply["error"]:
                raise RuntimeError(f"{method}: {reply['error']}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version


def dict_source(tensors: dict[str, torch.Tensor]) -> Any:
    """A vLLM `WeightSource` over a dict the test replaces each round (new storage)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def __init__(self) -> None:
            self.tensors = tensors

        @cached_property
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def iter_local(self):  # noqa: ANN202 - vLLM's signature
            yield from self.tensors.items()

    return DictSource()
