"""One rank of the Megatron-Core oracle (run as a script by test_megatron_oracle.py).

Builds a real GPTModel (local spec, CPU, fp32, gloo) for the parallel config in argv[1]
(JSON: {"hf": {...}, "source": {...}, "port": N}), then checks against our layout:
(1) names and shapes of `named_parameters()` (+ `router.expert_bias`) equal ours, in
order; (2) after copying our `materialize`d tensors into the params, the gathered logits
equal the HF model's (transformers on CPU, same logical tensors). DeepSeek-V3 (MLA, shared
experts, `router.expert_bias`) is checked for (1) only: MLA's core attention needs more than
the four CUDA patches for a CPU forward. Exits non-zero on a mismatch, printing it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from harness.weights import materialize, random_full_tensors  # noqa: E402
from planner.layouts import megatron  # noqa: E402
from tests.support.megatron import batch, build, logits_code, patch_mla, start  # noqa: E402


def main() -> int:
    rank, hf, cfg, spec = start()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    names_only = hf["model_type"] == "deepseek_v3"
    if names_only:
        patch_mla()
    ps.initialize_model_parallel(cfg.tp, cfg.pp, expert_model_parallel_size=cfg.ep,
                                 expert_tensor_parallel_size=cfg.expert_tp)
    with contextlib.suppress(Exception):
        model_parallel_cuda_manual_seed(0)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), cfg.pp
    ours = megatron.layout(spec, cfg).ranks[rank]
    vocab = ours.tensors[0].shape[0] * cfg.tp if pp_rank == 0 else megatron.padded_vocab(
        spec.dims.vocab, cfg)
    model = build(hf, cfg, vocab, pp_rank == 0, pp_rank == pp - 1).eval()
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    real += [(n, tuple(b.shape)) for n, b in model.named_buffers() if n.endswith("expert_bias")]
    mine = [(t.name, t.shape) for t in ours.tensors]
    if real != mine:
        print(f"rank {rank}: names/shapes differ\nreal {real}\nours {mine}", flush=True)
        return 1
    if names_only:
        dist.destroy_process_group()
        return 0
    full = {k: v.float() for k, v in random_full_tensors(spec, seed=1, scale=0.2).items()}
    local = materialize(megatron.layout(spec, cfg), full, ranks=[rank])[rank]
    params = dict(model.named_parameters())
    params |= {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    with torch.no_grad():
        for name, t in local.items():
            params[name].copy_(t)
    ids, pos, mask = batch(spec.dims.vocab)
    with torch.no_grad():
        if pp_rank > 0:
            hidden = torch.empty(6, 2, spec.dims.hidden)
            dist.recv(hidden, src=rank - cfg.tp * cfg.dp)
            model.set_input_tensor(hidden)
        out = model(ids, pos, mask)
        if pp_rank < pp - 1:
            dist.send(out, dst=rank + cfg.tp * cfg.dp)
    code = 0
    if pp_rank == pp - 1:
        code = logits_code(out, cfg.tp, spec.dims.vocab, hf, full, ids, rank)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
