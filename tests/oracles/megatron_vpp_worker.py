"""One rank of the Megatron-Core virtual-pipeline oracle (run by test_megatron_vpp_oracle.py).

Builds this PP rank's `vpp` real GPTModel chunks (`vp_stage=v`, local spec, CPU, fp32,
gloo) under `virtual_pipeline_model_parallel_size`, then checks against our layout:
(1) names and shapes, chunk by chunk (`model{v}.` + the chunk's `named_parameters()`),
equal ours in order; (2) each chunk's layers carry Megatron's own global `layer_number`
equal to `chunk_layers` (+1); (3) after copying our `materialize`d shards in, running the
chunks in the interleaved order (stage 0 chunk 0, stage 1 chunk 0, ..., stage 0 chunk 1,
...) gives logits equal to the HF model's. argv[1] = JSON {"hf", "source", "port"}.
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
from schemas.config import SourceConfig  # noqa: E402
from tests.support.megatron import batch, build, logits_code, start  # noqa: E402


def _forward(chunks: list, cfg: SourceConfig, rank: int, p: int, ids, pos, mask, hidden_size):
    """The chunks in interleaved order: (stage 0, chunk 0), (1, 0), ..., (0, 1), ..."""
    stage = cfg.tp * cfg.dp
    prev = rank - stage if p > 0 else rank + (cfg.pp - 1) * stage
    nxt = rank + stage if p < cfg.pp - 1 else rank - (cfg.pp - 1) * stage
    out = None
    for v, chunk in enumerate(chunks):
        if not (p == 0 and v == 0):
            hidden = torch.empty(ids.shape[1], ids.shape[0], hidden_size)
            dist.recv(hidden, src=prev)
            chunk.set_input_tensor(hidden)
        out = chunk(ids, pos, mask)
        if not (p == cfg.pp - 1 and v == cfg.vpp - 1):
            dist.send(out.contiguous(), dst=nxt)
    return out


def main() -> int:
    rank, hf, cfg, spec = start()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(cfg.tp, cfg.pp, virtual_pipeline_model_parallel_size=cfg.vpp)
    with contextlib.suppress(Exception):
        model_parallel_cuda_manual_seed(0)
    p = ps.get_pipeline_model_parallel_rank()
    vocab = megatron.padded_vocab(spec.dims.vocab, cfg)
    chunks = [build(hf, cfg, vocab, p == 0 and v == 0, p == cfg.pp - 1 and v == cfg.vpp - 1,
                    vp_stage=v).eval() for v in range(cfg.vpp)]
    ours = megatron.layout(spec, cfg).ranks[rank]
    real = [(f"model{v}.{n}", tuple(t.shape)) for v, c in enumerate(chunks)
            for n, t in c.named_parameters()]
    mine = [(t.name, t.shape) for t in ours.tensors]
    if real != mine:
        print(f"rank {rank}: names/shapes differ\nreal {real}\nours {mine}", flush=True)
        return 1
    want = megatron.chunk_layers(spec.dims.num_layers, cfg)[p]
    got = [[layer.layer_number - 1 for layer in c.decoder.layers] for c in chunks]
    if got != [list(r) for r in want]:
        print(f"rank {rank}: global layers of the chunks: real {got}, ours {want}", flush=True)
        return 1
    print(f"rank {rank}: pp {p} chunks hold global layers {got}", flush=True)
    full = {k: v.float() for k, v in random_full_tensors(spec, seed=3, scale=0.2).items()}
    local = materialize(megatron.layout(spec, cfg), full, ranks=[rank])[rank]
    params = {f"model{v}.{n}": t for v, c in enumerate(chunks) for n, t in c.named_parameters()}
    with torch.no_grad():
        for name, t in local.items():
            params[name].copy_(t)
        ids, pos, mask = batch(spec.dims.vocab)
        out = _forward(chunks, cfg, rank, p, ids, pos, mask, spec.dims.hidden)
    code = 0
    if p == cfg.pp - 1:
        code = logits_code(out, cfg.tp, spec.dims.vocab, hf, full, ids, rank)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
