"""One model in a worker: rdma-plan over each transport, then the baseline."""

from __future__ import annotations

import json
import os
import traceback

from bench import step_trace
from bench.gpu_refit.baseline import run_baseline
from bench.gpu_refit.ctx import Ctx, StepError
from bench.gpu_refit.floor import measure_floor
from bench.gpu_refit.setup import NO_MULTICAST, Setup, now
from bench.gpu_refit.weights import check_generator, check_targets, generate
from schemas.protocol import INFLIGHT


def transport_variant(entry: str) -> tuple[str, dict, int]:
    """A `--transports` entry -> (transport, its options, batches in flight):
    `cuda_ipc:N` uses N copy streams, `cuda_ipc-raw` posts copies one by one (no CUDA
    graphs), `cuda_ipc-engines` keeps the copy engines (no copy kernel); `nixl-nosgl`
    posts a put per write (no scatter-gather); `-whole` (any transport) runs a stage's
    packs whole before its writes (`pack_groups=0`, no `executor/pipeline.py`); a suffix
    `@M` keeps M batches in flight (default 8); `+NAME=VALUE` (repeatable, before `@`)
    sets one more transport option (e.g. `cuda_ipc+beside_packs_kernel_share=0.5`,
    `cuda_ipc+memcpy_batch=false`)."""
    tr, _, inflight = entry.partition("@")
    tr, *extra = tr.split("+")
    kind, _, streams = tr.partition(":")
    kind = kind.removesuffix("-whole")  # the executor's option (`rdma_plan`)
    options: dict = {}
    if kind.startswith("cuda_ipc"):  # variants, for comparisons in one run
        options = cuda_ipc_options(int(streams or 4), graphs=not kind.endswith("-raw"),
                                   kernel=not kind.endswith("-engines"))
        kind = "cuda_ipc"
    elif kind.startswith("nixl"):
        options = {"sgl": not kind.endswith("-nosgl")}
        kind = "nixl"
    for item in extra:
        name, _, value = item.partition("=")
        options[name] = (value == "true" if value in ("true", "false") else
                         float(value) if "." in value else int(value))
    return kind, options, int(inflight or INFLIGHT)


def cuda_ipc_options(streams: int, graphs: bool, kernel: bool = True) -> dict:
    """The cuda_ipc transport's options (`executor.load(..., transport_options=...)`)."""
    return {"streams": streams, "graphs": graphs, "copy_kernel": kernel}


def run_model(ctx: Ctx, model: str, plan_path: str, out: dict, save,
              transports: list[str], baseline: bool = True) -> dict:
    import executor
    from harness.weights import DTYPES
    from planner.frameworks import build_layout
    from planner.spec import load_spec

    torch, dist, args, rank = ctx.torch, ctx.dist, ctx.args, ctx.rank
    setup = ctx.setup
    cfg = setup.config(model, args.max_write_mib, args.staging_mib)
    spec = load_spec(cfg.model_config_path)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    assert (src.world, dst.world) == (len(setup.trainers), len(setup.targets)), \
        (src.world, dst.world)
    is_src = rank in setup.trainers
    rl = src.ranks[rank] if is_src else dst.ranks[rank - len(setup.trainers)]
    fp8 = cfg.target.dtype == "fp8_block128"
    if not ctx.gpu and rank in (0, *(() if fp8 else (setup.targets[0],))):
        layout, local = (src, 0) if rank == 0 else (dst, 0)
        bad = check_generator(spec, layout, local, seed=5)
        print(f"[rank {rank}] generator vs materialize: "
              f"{'OK' if not bad else 'MISMATCH ' + str(bad[:3])}", flush=True)
        if bad:
            raise SystemExit(f"generator disagrees with materialize on {bad[:3]}")
    t0 = now()
    tensors = {pt.name: torch.empty(pt.shape, dtype=DTYPES[pt.dtype], device=ctx.device)
               for pt in rl.tensors}
    mine = sum(t.numel() * t.element_size() for t in tensors.values())
    ctx.barrier()
    seed = 1

    def fresh(seed: int) -> None:
        if is_src:
            generate(tensors, rl, spec, seed)
        else:
            for t in tensors.values():
                t.zero_()
        ctx.barrier()

    def verify(label: str, seed: int) -> bool:
        counts = {"cpu_budget": args.fp8_cpu_check}
        bad = check_targets(tensors, rl, spec, seed, counts) if not is_src else []
        allbad = ctx.gather(bad)
        ok = not any(allbad)
        checked = ctx.gather({k: counts.get(k, 0) for k in ("cpu", "gpu")})
        if fp8:
            out.setdefault("fp8_checked", {})[label] = checked
        if rank == 0:
            where = (f" (FP8 elements against the reference quantizer, per rank, on CPU / "
                     f"GPU: {[(c['cpu'], c['gpu']) for c in checked]})" if fp8 else "")
            print(f"[{model}] {label}: inference tensors bit-exact: "
                  f"{'yes' if ok else 'NO ' + str([b[:3] for b in allbad])}{where}",
                  flush=True)
        return ok

    fresh(seed)
    if rank == 0:
        print(f"[{model}] weights ready in {now() - t0:.1f} s ({mine / 1e9:.2f} GB on rank 0)",
              flush=True)

    def rdma_plan(tr: str) -> None:
        nonlocal seed
        label = f"rdma-plan ({tr})"
        if seed != 1:
            seed += 1
            fresh(seed)
        ctx.runs += 1
        ex, err, t0 = None, None, now()
        try:  # a fresh key prefix per load: never meet a closed executor's descriptors
            store = dist.PrefixStore(f"rplan-{ctx.runs}-{model}-{tr}", ctx.store)
            kind, options, inflight = transport_variant(tr)
            if kind == "nixl":  # read when the agent's UCX backend is created
                os.environ["NIXL_UCX_SGL_ENABLE"] = "1" if options.get("sgl", True) else "0"
            whole = tr.partition("@")[0].partition("+")[0].partition(":")[0].endswith("-whole")
            ex = executor.load(plan_path, rank=rank, tensors=tensors, transport=kind,
                               rendezvous=store, timeout_s=args.exec_timeout,
                               max_inflight=inflight, no_identity=True,
                               step_records=os.environ.get("BENCH_STEP_RECORDS", "1") != "0",
                               pack_groups=0 if whole else None,
                               **({"transport_options": options} if options else {}))
        except Exception as e:  # noqa: BLE001 - printed, and the rank reports it
            traceback.print_exc()
            err = f"rank {rank}: {type(e).__name__}: {e}"
        load_s = now() - t0
        errors = [e for e in ctx.gather(err) if e]  # every rank agrees to go on or not
        if errors:
            if ex is not None:
                ex.close()
            out["methods"][label] = {"error": errors[0]}
            save()
            return
        try:
            last = {}
            folder = os.environ.get("BENCH_TRACE")  # each rank's host events of each step
            trace = step_trace.attach(ex) if folder else None

            def step(ex=ex, last=last):
                if args.inject_failure and rank == 1 and ex.step == 0:  # test of StepError
                    raise RuntimeError("injected failure")
                last["stats"] = executor.run(ex)
                if trace is not None:  # the step's end as timed: after this rank's sync
                    ctx.sync()
                    step_trace.mark(trace, "timed end (synced)")

            res = ctx.timed(step, args.warmup, args.steps)
            if trace is not None:
                where = os.path.join(folder, "".join(
                    c if c.isalnum() else "_" for c in f"{model}_{tr}"))
                step_trace.save(where, rank, trace)
                ctx.barrier()
                if rank == 0:
                    table = step_trace.report_ranks(where, list(range(setup.world)),
                                                    args.warmup)
                    print(f"[{model}] {label}: host events (BENCH_TRACE)\n{table}", flush=True)
            res["load_s"] = load_s
            if rank == 0:
                print(f"[{model}] {label}: median {res['median']:.4f} s, the ranks' starts "
                      f"{res['start_skew_us']:.1f} us apart (median)", flush=True)
            res["bit_exact"] = verify(label, seed)
            if not ctx.gpu and rank == setup.targets[0] and res["bit_exact"]:  # the check can fail
                t = next(iter(tensors.values()))
                t.view(-1)[0] += 1
                caught = check_targets(tensors, rl, spec, seed)
                t.view(-1)[0] -= 1
                assert caught, "check_targets missed a corrupted element"
                print(f"[rank {rank}] a corrupted element is caught: {caught}", flush=True)
            res["run_seconds_last_step_per_rank"] = ctx.gather(last["stats"].seconds)
            res["bytes_written_per_rank"] = ctx.gather(ex.bytes_per_step)
            tstats = ex.transport.stats()
            res["device_copies_per_rank"] = ctx.gather(tstats.get("device_copies"))
            res["raw_copies_per_rank"] = ctx.gather(bool(tstats.get("raw_copies")))
            ctx.profile(step, f"{model} {label}")
        except StepError as e:  # every rank got it: keep going with the other methods
            res = {"error": str(e)}
        finally:
            ex.close()
        out["methods"][label] = res
        save()

    for tr in transports:
        rdma_plan(tr)
    if baseline and not fp8:  # the NCCL baseline moves bf16 (no quantizer)
        seed += 1
        fresh(seed)
        run_baseline(ctx, model, spec, src, dst, tensors, out, verify, seed)
        save()
    out["target_bytes"] = ctx.gather(0 if is_src else mine)[setup.targets[0]]
    out["model_bytes"] = spec.total_params * 2
    tensors.clear()
    if ctx.gpu:
        torch.cuda.empty_cache()
    ctx.barrier()
    return out


def worker(args) -> int:
    os.environ.update(NO_MULTICAST)
    rank = args.worker
    ctx = Ctx(args, rank, Setup.for_gpus(args.gpus))
    results = {"floor": None, "models": []}
    try:
        results["floor"] = measure_floor(ctx)
        if rank == 0:
            print(f"floor: {json.dumps(results['floor'])}", flush=True)
        def save() -> None:
            if rank == 0:
                with open(args.results, "w") as f:
                    json.dump(results, f, indent=1)

        for model, plan in zip(args.models, args.plans):
            out = {"model": model, "methods": {}}
            results["models"].append(out)
            run_model(ctx, model, plan, out, save, args.transports[:1], not args.no_baseline)
        # other transports (e.g. nixl) after every model's main results: a hang costs less
        for out, plan in zip(results["models"], args.plans):
            if args.transports[1:]:
                run_model(ctx, out["model"], plan, out, save, args.transports[1:], False)
    finally:
        if rank == 0:
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)
    ctx.dist.destroy_process_group()
    return 0
