"""Who runs where: the cluster of the compile config, the model cases and the ranks."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS_DIR = os.path.join(ROOT, "plans", "models")
DENSE = (dict(framework="megatron", tp=2, dtype="bfloat16"), dict(engine="vllm", tp=2))
MOE = (dict(framework="megatron", tp=1, dp=2, ep=2, dtype="bfloat16"),
       dict(engine="vllm", tp=2, ep=True))
ONE_TO_ONE = (dict(framework="megatron", tp=1, dtype="bfloat16"), dict(engine="vllm", tp=1))
MODELS = ("qwen3-8b", "qwen3-30b-a3b", "tiny-qwen3", "tiny-qwen3-moe")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def fp8(case: tuple[dict, dict]) -> tuple[dict, dict]:
    """`case` with block-FP8 inference weights."""
    return case[0], {**case[1], "dtype": "fp8_block128"}


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Setup:
    """One host's GPUs split into trainers (the source) and inference ranks (the target)."""

    cluster: dict
    """The `cluster` section of every compile config."""
    cases: dict[str, tuple[dict, dict]]
    """Model dir (":fp32": fp32 trainer weights) -> (source section, target section)."""
    world: int
    """Processes, one per GPU."""
    trainers: tuple[int, ...]
    """Ranks of the trainers (plan ranks 0..)."""
    targets: tuple[int, ...]
    """Ranks of the inference engine."""
    gpus: tuple[int, ...] = ()
    """Each rank's GPU index (default: its rank); `--gpus 1` puts both ranks on GPU 0."""

    def gpu(self, rank: int) -> int:
        return self.gpus[rank] if self.gpus else rank

    @staticmethod
    def for_gpus(n: int) -> Setup:
        """4 GPUs (the issue's setup): trainers 0-1 (Megatron TP 2 or EP 2), inference 2-3
        (vLLM TP 2). 2 GPUs: one trainer (GPU 0) and one inference GPU (GPU 1), TP 1 on both
        sides (a "MODEL:fp32" case keeps fp32 weights on the trainer: every chunk is cast,
        so packed into staging, which exercises early packs and writes in flight across
        stages). Any "MODEL:fp8" case has block-FP8 inference weights (`target.dtype:
        fp8_block128`): the bf16 sources quantize into staging before the writes. 1 GPU: the
        2-GPU ranks and plans, both processes on GPU 0 (copies within one GPU; no NCCL
        baseline: NCCL refuses two ranks on one device)."""
        if n == 4:  # DENSE is plans/qwen3-8b_megatron-tp2_vllm-tp2.yaml
            cases = {"qwen3-8b": DENSE, "qwen3-30b-a3b": MOE, "tiny-qwen3": DENSE,
                     "tiny-qwen3-moe": MOE}
            cases.update({f"{m}:fp8": fp8(c) for m, c in cases.items()})
            return Setup(dict(placement="colocated", hosts=1, gpus_per_host=4, nics_per_host=4,
                              source_gpus_per_host=2), cases, 4, (0, 1), (2, 3))
        if n not in (1, 2):
            raise SystemExit(f"--gpus {n}: 4 (the issue's setup), 2, or 1 (the 2-GPU ranks "
                             "both on GPU 0)")
        fp32 = ({**ONE_TO_ONE[0], "dtype": "float32"}, ONE_TO_ONE[1])
        cases = {**{m: ONE_TO_ONE for m in MODELS}, **{f"{m}:fp32": fp32 for m in MODELS},
                 **{f"{m}:fp8": fp8(ONE_TO_ONE) for m in MODELS}}
        return Setup(dict(placement="colocated", hosts=1, gpus_per_host=2, nics_per_host=2,
                          source_gpus_per_host=1), cases, 2, (0,), (1,), (0, 0) if n == 1 else ())

    def config(self, model: str, max_write_mib: int | None = None,
               staging_mib: int | None = None):
        """The compile config of `model` on this setup (`schemas.config.Config`)."""
        from schemas.config_load import config_from_dict

        source, target = self.cases[model]
        data = {"model": {"config": f"{model.split(':')[0]}/config.json"}, "source": source,
                "target": target, "cluster": self.cluster}
        options = {**({"max_write_bytes": max_write_mib << 20} if max_write_mib else {}),
                   **({"staging_bytes": staging_mib << 20} if staging_mib else {})}
        if options:
            data["options"] = options
        return config_from_dict(data, base_dir=MODELS_DIR)
