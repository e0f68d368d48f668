"""One rank of a real SGLang 0.5.23 engine on CPU, compared with our SGLang layout.

argv[1] is JSON: {"port": ..., "cases": [{"name", "hf", "tp", "pp", "ep", "dp",
"dp_attention", "swap_kv"}]}; every case's engine spans the whole WORLD (tp * pp ==
WORLD_SIZE; world rank = pp_rank * tp + tp_rank = our layout rank). For each case:
build SGLang's model for this rank (`sglang_env.build`: its own parallel groups over gloo,
`get_model` with dummy weights), load random HF tensors through `model.load_weights`, and
compare every `named_parameters()` entry bit-exactly with `materialize(layout, full)` for
this rank: names and their order, shapes, dtypes, values. `swap_kv` (the negative control)
swaps KV heads 0 and 1 of every `k_proj` in what SGLang loads: that case passes only if
the comparison reports `qkv_proj` values differing. Exits non-zero with the differences.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.oracles import sglang_env  # noqa: E402

sglang_env.prepare()

import torch  # noqa: E402

from tests.support.engine_params import differences  # noqa: E402


def swap_kv_heads(full: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    out = dict(full)
    for name, t in full.items():
        if name.endswith("k_proj.weight"):
            out[name] = torch.cat([t[head_dim:2 * head_dim], t[:head_dim], t[2 * head_dim:]])
    return out


KEEP: list[object] = []
"""Every case's model stays alive until exit (ids of freed models are not reused)."""


def run_case(case: dict, rank: int) -> list[str]:
    from harness.weights import materialize, random_full_tensors
    from planner.layouts import sglang as sglang_layout
    from planner.spec import spec_from_hf
    from schemas.config import TargetConfig

    spec = spec_from_hf(case["hf"], mtp=False)
    tp, pp, dp, ep, dpa = case["tp"], case.get("pp", 1), case.get("dp", 1), \
        case.get("ep", False), case.get("dp_attention", False)
    target = TargetConfig(engine="sglang", tp=tp, pp=pp, dp=dp, ep=ep, dp_attention=dpa,
                          dtype="float32")
    full = random_full_tensors(spec, seed=7)
    want = materialize(sglang_layout.layout(spec, target), full, ranks=[rank])[rank]
    args = sglang_env.server_args(case["hf"], tp=tp, pp=pp, ep=ep, dp=dp, dp_attention=dpa)
    try:
        model = sglang_env.build(args, rank)
        KEEP.append(model)
        loaded = swap_kv_heads(full, spec.dims.head_dim) if case.get("swap_kv") else full
        with torch.no_grad():
            model.load_weights(iter(loaded.items()))
        got = {n: p.detach() for n, p in model.named_parameters()}
    finally:
        sglang_env.teardown()
    errors = differences(got, want, "SGLang")
    if case.get("swap_kv"):  # the negative control passes only if the oracle caught it
        caught = any("qkv_proj.weight" in e and "elements differ" in e for e in errors)
        errors = [] if caught else [f"swapped KV heads not caught: {errors[:3]}"]
    return [f"{case['name']} rank {rank}: {e}" for e in errors]


def main() -> None:
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(arg["port"]))
    sglang_env.init_world(rank, world, arg["port"])
    errors = []
    for case in arg["cases"]:
        try:
            errors += run_case(case, rank)
        except Exception as e:  # noqa: BLE001 - report it with the other cases' results
            errors.append(f"{case['name']} rank {rank}: {type(e).__name__}: {e}")
        print(f"rank {rank}: {case['name']} done", flush=True)
    if errors:
        print("\n".join(errors[:50]), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
