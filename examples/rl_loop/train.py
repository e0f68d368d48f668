"""Trainer ranks of the RL loop (run under torchrun by `run.py`; one process per rank).

Each rank builds the tiny Qwen3 (transformers, fp32, random init with one seed), shards it
(FSDP2: `fully_shard` over a 2-rank `dp_shard` mesh; Megatron-Core: a GPTModel with tensor
parallelism 2), binds its shards to the compiled plan (`integrations.fsdp2.bind` /
`integrations.megatron.bind`) and hands that binding (plan rank, identity and the live shards)
to vLLM's trainer factory (`RdmaPlanTrainerInitInfo(binding=...)`; rank 0 drives the engine
with vLLM's `HTTPVLLMWeightSyncClient`).
Then the initial sync (step-0: the initial weights, no training) and K training steps (AdamW
on next-token loss); after each: pause the engine, send the weights (start, update, finish
through vLLM's API), resume, generate, and check:
  - the engine's prompt logprobs of fixed token ids equal this trainer's own forward
    (max |delta logprob| printed, fp32 tolerance);
  - the engine's weight version is the step's and advanced;
  - the engine holds the trainer's bytes: vLLM's own per-tensor sha256
    (`/weight_checker`, `compute_weight_checksums` on every worker) equals the sha256 of
    the tensors the plan's target layout builds from the trainer's gathered weights.
Prints the engine's pause (generation stopped: pause, transfer, resume) and the transfer
(start/update/finish) time per step.

`--shadow` (zero-pause refit, `RdmaPlanTrainerInitInfo(shadow=True)`; `refit.py`): each rank
`start_send`s while the engine keeps serving, then rank 0 pauses the engine, `finish_send`s
(the engine switches the shadow in and commits) and resumes: the pause is the switch, not the
transfer. Both modes run client threads on rank 0 (`serving.py`) sending completions
throughout; per step also checked: every request answered before the pause took effect saw
version N (its probe logprobs equal N's), every one sent after it saw N+1, none a mix; in
shadow mode the engine generated tokens during the transfer (vLLM's own counter).
`--throttle-ms` (a slow source) and `--stall-step` (a torn transfer: rank 1 stalls past the
plan's timeout; shadow: version N must keep serving, its version, logprobs and bytes; paused:
the live weights hold part of N+1, so the engine stays paused and every rank sends again, then
N+1 is checked as any step) test both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import urllib.request
from typing import Any

import torch
import torch.distributed as dist
from refit import paced_engine, refit
from serving import Client, post, probe_logprobs, sort_requests


def early_vllm_log_level() -> None:
    """`VLLM_LOGGING_LEVEL` for the lines vLLM logs while it is imported, before its own
    logging is set up (they would go through Python's last-resort handler whatever the
    variable says: "Triton is installed, but doesn't include CPU backend")."""
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level:
        logging.getLogger("vllm").setLevel(level.upper())


def get(url: str, path: str) -> Any:
    with urllib.request.urlopen(f"{url}/{path}", timeout=60) as r:
        return json.loads(r.read())


def build_fsdp2(model_dir: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # every rank starts from the same weights
    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_megatron(model_dir: str) -> torch.nn.Module:
    """A Megatron-Core GPTModel (local layers, no Transformer Engine) with TP over all ranks;
    on CPU: four CUDA assumptions of Megatron-Core 0.16.1 patched out (no GPU here)."""
    import contextlib

    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    torch.cuda.current_device = lambda: "cpu"  # RoPE
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    torch.manual_seed(0)  # every TP rank draws the same full weights and keeps its part
    tc = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"],
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True,
        params_dtype=torch.float32, init_method_std=0.02, bias_activation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(tc, spec, vocab_size=hf["vocab_size"], max_sequence_length=256,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=hf["rope_theta"])


def megatron_forward(model: torch.nn.Module, ids: torch.Tensor,
                     labels: torch.Tensor | None = None) -> torch.Tensor:
    """Loss per token (with labels) or the full logits gathered over the TP group."""
    from megatron.core import parallel_state as ps

    s = ids.shape[1]
    pos = torch.arange(s).expand_as(ids)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    out = model(ids, pos, mask, labels=labels)
    if labels is not None:
        return out
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)


def sum_qk_norm_grads(model: torch.nn.Module) -> None:
    """Megatron's `finalize_model_grads` rule for q/k layernorms under TP (without its DDP
    wrapper): each TP rank holds the whole weight but sees only its heads, so the gradients
    are summed over the TP group; without it the replicas drift apart rank by rank."""
    from megatron.core import parallel_state as ps

    for name, p in model.named_parameters():
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def expected_digests(config: str, model_config: str, plan_rank: int,
                     shards: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor the engine must hold, keyed as vLLM's weight checker keys them
    (`dp0:pp0:pcp0:tp{t}:{name}`): the trainer's shards are gathered to rank 0, put back
    into full logical tensors with the source layout, and laid out with the target's
    (`harness.weights.assemble`, `layout_digests`)."""
    from harness.weights import assemble, layout_digests
    from planner.frameworks import build_layout
    from planner.spec import spec_from_hf
    from schemas.config_load import load_config

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (plan_rank, {n: t.detach().clone()
                                                  for n, t in shards.items()}))
    parts = dict(gathered)
    if dist.get_rank() != 0:
        return {}
    cfg = load_config(config)
    with open(model_config) as f:
        hf = json.load(f)
    spec = spec_from_hf(hf, mtp=False)
    full = {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in spec.tensors}
    assemble(build_layout(spec, cfg.source, hf), parts, full)
    return {f"dp0:pp0:pcp0:tp{r}:{name}": digest
            for r, sums in layout_digests(build_layout(spec, cfg.target, hf), full).items()
            for name, digest in sums.items()}


def trainer_logprobs(model: torch.nn.Module, ids: list[int], variant: str) -> torch.Tensor:
    with torch.no_grad():
        if variant == "megatron":
            logits = megatron_forward(model, torch.tensor([ids]))[0].float()
        else:
            logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def engine_logprobs(url: str, model_dir: str, ids: list[int]) -> tuple[torch.Tensor, list]:
    out = post(url, "v1/completions", {"model": model_dir, "prompt": ids, "max_tokens": 4,
                                       "temperature": 0, "prompt_logprobs": 0,
                                       "return_token_ids": True})
    choice = out["choices"][0]
    return probe_logprobs(choice, ids), choice.get("token_ids")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["fsdp2", "megatron"], default="fsdp2")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--plan-key", required=True, help="the key the plan is signed with")
    ap.add_argument("--config", required=True, help="the plan's YAML config")
    ap.add_argument("--model", required=True, help="the model folder vLLM serves")
    ap.add_argument("--url", required=True, help="the vLLM server, http://host:port")
    ap.add_argument("--rendezvous", help="host:port of the plan's store, hosted by plan rank 0 "
                    "(default: torchrun's own store, MASTER_ADDR:MASTER_PORT, every trainer "
                    "rank and vLLM worker a client of it: no second port)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--shadow", action="store_true",
                    help="zero-pause refit: start_send while the engine serves, pause only "
                         "around finish_send")
    ap.add_argument("--throttle-ms", type=float, default=0.0,
                    help="a slow source: every rank starts its writes this late")
    ap.add_argument("--throttle-steps", default="",
                    help="the steps --throttle-ms applies to, e.g. 2,4 (default: all)")
    ap.add_argument("--stall-step", type=int, default=-1,
                    help="a torn transfer: at this step trainer rank 1 stalls past the "
                         "plan's timeout (its DONE never comes in time); version N must stay")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the plan's peer timeout")
    ap.add_argument("--clients", type=int, default=2,
                    help="client threads sending completions throughout (0: none)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    early_vllm_log_level()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    import integrations.fsdp2
    import integrations.megatron
    from integrations.vllm import RdmaPlanTrainerInitInfo, TornUpdateError, register

    register()
    if args.variant == "megatron":
        model = build_megatron(args.model)
        binding = integrations.megatron.bind(args.plan, [model])
    else:
        model = build_fsdp2(args.model)
        binding = integrations.fsdp2.bind(args.plan, model)
    client = HTTPVLLMWeightSyncClient(args.url)
    # the binding: plan rank, identity and the live shards, derived together from the
    # framework (read again at trainer_init; a part compiled for another rank is refused
    # before anything is registered)
    # the plan's store: torchrun's (its agent hosts it for the job), unless --rendezvous
    torchrun = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    info = RdmaPlanTrainerInitInfo(rank=rank, plan=args.plan,
                                   rendezvous=args.rendezvous or torchrun,
                                   rendezvous_hosted=args.rendezvous is None,
                                   binding=binding, plan_key=args.plan_key,
                                   shadow=args.shadow, timeout_s=args.timeout_s)
    steps = [int(x) for x in args.throttle_steps.split(",") if x] or range(args.steps + 1)
    delays = {k: args.throttle_ms / 1e3 for k in steps} if args.throttle_ms else {}
    if args.stall_step >= 0 and rank == 1:
        delays[args.stall_step] = args.timeout_s + 5
    factory = paced_engine(delays) if delays else WeightTransferTrainerFactory
    engine = factory.trainer_init(info, client=client)  # sends the binding's tensors
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    probe = [(i * 37 + 11) % vocab for i in range(24)]  # the fixed token ids checked
    gen = torch.Generator().manual_seed(1234 + rank)
    version, failures, want, old = None, 0, {}, None
    serving = None
    if rank == 0:
        old = engine_logprobs(args.url, args.model, probe)[0]  # version N before step 0
        if args.clients:
            serving = Client(args.url, args.model, probe, threads=args.clients).start()
    for step in range(args.steps + 1):
        loss = float("nan")
        if step > 0:  # one optimizer step on this rank's batch (FSDP2 averages the grads)
            if args.variant == "megatron":  # TP ranks share the batch
                g = torch.Generator().manual_seed(1000 + step)
                batch = torch.randint(0, vocab, (4, 33), generator=g)
                loss_t = megatron_forward(model, batch[:, :-1], batch[:, 1:]).mean()
                loss_t.backward()
                sum_qk_norm_grads(model)
            else:  # data parallel: each rank its own batch
                batch = torch.randint(0, vocab, (4, 32), generator=gen)
                loss_t = model(batch, labels=batch).loss
                loss_t.backward()
            opt.step()
            opt.zero_grad()
            loss = loss_t.item()
        label = f"step-{step}"
        engine.step = step
        t, torn = refit(engine, args, label, rank, TornUpdateError)
        previous = want
        want = expected_digests(args.config, os.path.join(args.model, "config.json"),
                                binding.rank, binding.tensors)
        mine = trainer_logprobs(model, probe, args.variant)  # a collective: every rank
        if rank != 0:
            continue
        theirs, generated = engine_logprobs(args.url, args.model, probe)
        got_version = get(args.url, "weight_info")["weight_version"]
        sums = post(args.url, "weight_checker", {"action": "checksum"})["checksums"]
        seen = serving.between(t["start"], time.perf_counter()) if serving else []
        requests = sort_requests(seen, t["paused"], old, None if torn else theirs,
                                 args.tolerance)
        if t["tokens"] < 0:  # paused: the tokens of requests answered during the transfer
            t["tokens"] = sum(r.tokens for r in seen if t["paused"] < r.done < t["finished"])
        timing = (f"pause {1e3 * (t['resumed'] - t['pause']):.1f} ms (pause call "
                  f"{1e3 * (t['paused'] - t['pause']):.1f}, finish "
                  f"{1e3 * (t['finished'] - t['paused']):.1f}, resume "
                  f"{1e3 * (t['resumed'] - t['finished']):.1f})  transfer "
                  f"{1e3 * t['transfer']:.1f} ms  tokens during transfer {t['tokens']:.0f}  "
                  f"{requests}")
        if t.get("resent"):  # paused and torn: sent again before the engine resumed
            held = t["torn_sums"]
            old_n = sum(held.get(k) == v for k, v in previous.items())
            new_n = sum(held.get(k) == v for k, v in want.items())
            print(f"{label}: paused refit TORN ({t['resent']}); while torn the engine held "
                  f"{old_n}/{len(previous)} tensors equal N's, {new_n} equal N+1's; it stayed "
                  "paused and the trainer sent it again", flush=True)
        if torn:  # version N must still serve: its version, logprobs and bytes
            delta = (old - theirs).abs().max().item()
            wrong = [k for k, v in previous.items() if sums.get(k) != v]
            ok = (delta <= args.tolerance and got_version == version and not wrong
                  and not requests.wrong and len(previous) > 0)
            print(f"{label}: TORN ({torn})  kept version {version} -> {got_version}  "
                  f"max|delta logprob| to N {delta:.2e}, to the trainer's N+1 "
                  f"{(mine - theirs).abs().max().item():.2e}  bytes "
                  f"{len(previous) - len(wrong)}/{len(previous)} tensors equal N's  {timing}  "
                  f"{'OK' if ok else 'FAIL'}", flush=True)
            want = previous
        else:
            delta = (mine - theirs).abs().max().item()
            wrong = [k for k, v in want.items() if sums.get(k) != v]
            during = t["tokens"] > 0 if args.shadow and serving else True
            ok = (delta <= args.tolerance and got_version == label and got_version != version
                  and not wrong and len(want) > 0 and not requests.wrong and during)
            what = "initial sync" if step == 0 else f"loss {loss:.4f}"  # 0: no training
            print(f"{label}: {what}  max|delta logprob| {delta:.2e}  version "
                  f"{version} -> {got_version}  bytes {len(want) - len(wrong)}/{len(want)} "
                  f"tensors equal  {timing}  N vs N+1 {(old - theirs).abs().max().item():.2e}"
                  f"  generated {generated}  {'OK' if ok else 'FAIL'}", flush=True)
            version, old = got_version, theirs
        failures += not ok
        for line in (wrong[:5] and [f"tensors that differ: {wrong[:5]}"]) + requests.wrong[:5]:
            print(f"  {line}", flush=True)
    if serving is not None:
        serving.stop()
        failures += bool(serving.errors)
        if serving.errors:
            print(f"  {len(serving.errors)} client request(s) failed: {serving.errors[:3]}")
    engine.shutdown()
    if rank == 0:  # release the engine's side too: another trainer run may connect next
        client.shutdown_weight_transfer_engine()
    ok_all = torch.tensor([failures])
    dist.broadcast(ok_all, 0)
    dist.destroy_process_group()
    if rank == 0:
        print("RL loop: " + ("all steps OK" if failures == 0 else f"{failures} step(s) FAILED"),
              flush=True)
    return int(ok_all.item() != 0)


if __name__ == "__main__":
    raise SystemExit(main())
