"""One rank of the FSDP2 oracle (run as a script by test_fsdp2_oracle.py).

Loads the HF model with transformers' `from_pretrained` from a checkpoint of random logical
tensors (CPU), applies torchtitan-style TP (`parallelize_module`
on the `tp` mesh dim, when tp > 1) and `fully_shard` (FSDP2) per layer and at the root
over `dp_shard` (HSDP when dp_replicate > 1), on gloo. Then checks our layout against the
real DTensors: names, order and local shapes, and values: every `to_local()` shard equals
our `materialize`d tensor of that rank. argv[1] is JSON {"hf", "source", "port"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from harness.weights import materialize, random_full_tensors  # noqa: E402
from planner.layouts import fsdp2  # noqa: E402
from planner.spec import spec_from_hf  # noqa: E402
from schemas.config import SourceConfig  # noqa: E402


def _tp_plan(model: torch.nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        kind = fsdp2.tp_dim(name + ".weight")
        if kind == 0:
            plan[name] = ColwiseParallel()
        elif kind == 1:
            plan[name] = RowwiseParallel()
    return plan


def _from_checkpoint(hf: dict, full: dict[str, torch.Tensor], spec) -> torch.nn.Module:
    """The HF model loaded by transformers' own `from_pretrained` from a checkpoint of the
    logical tensors (checkpoint names: transformers 5.x fuses and renames experts itself)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="fsdp2-oracle-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(hf, torch_dtype="float32"), f)
    save_file({k: v.reshape(spec.by_name[k].checkpoint_shape).contiguous()
               for k, v in full.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def main() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=arg["init"],
                            rank=rank, world_size=world)
    hf, cfg = arg["hf"], SourceConfig(framework="fsdp2", dtype="float32", **arg["source"])
    spec = spec_from_hf(hf)
    mesh = init_device_mesh("cpu", (cfg.dp_replicate, cfg.dp, cfg.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    full = {k: v.float() for k, v in random_full_tensors(spec, seed=2).items()}
    model = _from_checkpoint(hf, full, spec)
    if cfg.tp > 1:
        parallelize_module(model, mesh["tp"], _tp_plan(model))
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    real = []
    for name, p in model.named_parameters():
        real.append((name, p.to_local() if isinstance(p, DTensor) else p.data))
    real += [(n, b) for n, b in model.named_buffers() if "e_score" in n]
    ours = fsdp2.layout(spec, cfg)
    local = materialize(ours, full, ranks=[rank])[rank]
    names_real = [(n, tuple(t.shape)) for n, t in real]
    names_ours = [(t.name, t.shape) for t in ours.ranks[rank].tensors]
    code = 0
    if names_real != names_ours:
        print(f"rank {rank}: names/shapes differ\nreal {names_real}\nours {names_ours}")
        code = 1
    else:
        for name, t in real:
            if not torch.equal(t, local[name]):
                print(f"rank {rank}: values of {name} differ")
                code = 1
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
