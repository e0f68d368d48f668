"""One process of the adapter acceptance tests (run by test_adapters.py), over NIXL.

argv[1] = JSON {"role", "index", "plan", "config", "store", "steps", ...}.

- `megatron`: builds this rank's real Megatron-Core 0.16.1 model chunks (local spec, CPU,
  gloo; `vpp` chunks with `vp_stage`; optionally wrapped in `Float16Module` for bf16
  parameters), loads the test's logical weights into them, then calls only
  `integrations.megatron.bind` and the executor.
- `fsdp2`: builds the HF model (transformers), loads the weights, shards it with
  `fully_shard` (default 1-d mesh, or an HSDP mesh), then `integrations.fsdp2.bind` and the
  executor.
- `target`: a plain process: allocates what `schemas.tensors.rank_tensors` (the library
  function of `rdma-plan tensors`) lists, loads with the plan's identity (a chunked plan:
  `executor.ChunkedShadow`), and after every step compares every tensor bit-exactly with
  the target layout built from the same logical weights. Sources add 1 to every bound
  tensor between steps; a source of a chunked plan (`arg["chunked"]`) sends it through
  `integrations.trainer.load` and `executor.run_chunks`, after checking that the trainer
  path refuses the other source rank's identity on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

import executor  # noqa: E402
from harness.weights import materialize, random_full_tensors  # noqa: E402
from planner.frameworks import build_layout  # noqa: E402
from planner.layouts import megatron  # noqa: E402
from planner.validate import load  # noqa: E402
from schemas.errors import IdentityError  # noqa: E402
from schemas.tensors import rank_tensors  # noqa: E402
from tests.support.integration import RecordingClient  # noqa: E402


def _full(spec, step: int) -> dict[str, torch.Tensor]:
    """The logical weights of step `step` (+1 per step, rounded once to their dtype)."""
    return {k: (v.to(torch.bfloat16).float() + step).to(v.dtype)  # fp32 buffers: bf16-exact
            for k, v in random_full_tensors(spec, seed=5, scale=0.5).items()}


def _store(arg: dict) -> dist.TCPStore:
    """A client of the store the test hosts (it outlives every rank)."""
    from datetime import timedelta

    host, port = arg["store"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=120))


def _refused(arg: dict, tensors: dict[str, torch.Tensor], rank: int, ident: dict) -> None:
    """`arg["swap"]`: the ways a rank can be mixed up, each must raise `IdentityError`
    before anything is registered: the plan rank of the other TP rank (the launcher's order)
    with and without this process's identity, and this rank in a plan file whose two
    source parts were swapped (`arg["swapped"]`)."""
    other = arg["swap_to"][rank]
    tries = [(arg["plan"], other, {"identity": ident}), (arg["plan"], other, {}),
             (arg["swapped"], rank, {"identity": ident})]
    for path, r, kw in tries:
        try:
            executor.load(path, rank=r, tensors=tensors, transport="nixl",
                          rendezvous=_store(arg), timeout_s=120, **kw)
        except IdentityError as e:
            print(f"refused rank {r}: {e}", flush=True)
            continue
        raise AssertionError(f"plan rank {r} of {path} loaded ({kw})")


def _vllm_swapped(arg: dict, b) -> None:  # noqa: ANN001 - an integrations.Binding
    """`arg["vllm_swap"]`: this live trainer rank on the vLLM trainer path
    (`RdmaPlanTrainerEngine.trainer_init`) handed the other rank's identity, as a launcher's
    bug would: as `identity=` beside its own tensors, as its binding with the identity (and
    rank) replaced, and beside its own binding. Each must be refused before the client is
    asked for anything; a load that is accepted sends its tensors to the target (one step)."""
    import dataclasses

    from vllm.distributed.weight_transfer.base import ModuleSource

    from integrations.vllm import RdmaPlanTrainerEngine, RdmaPlanTrainerInitInfo
    from tests.support.integration import module

    other = arg["vllm_swap"][b.rank]
    index = arg["index"]
    tries = [("identity=", {"identity": other["identity"]}, ModuleSource(module(b.tensors))),
             ("binding", {"binding": dataclasses.replace(b, identity=other["identity"],
                                                         rank=other["rank"])}, None),
             ("binding+identity=", {"binding": b, "identity": other["identity"]}, None)]
    for what, kw, source in tries:
        client = RecordingClient()
        info = RdmaPlanTrainerInitInfo(plan=arg["plan"], rendezvous=arg["rendezvous"],
                                       rank=index, timeout_s=arg["timeout_s"],
                                       allow_unsigned=True, **kw)  # the test's plan: unsigned
        try:
            eng = RdmaPlanTrainerEngine.trainer_init(info, client=client, source=source)
        except IdentityError as e:
            assert client.calls == [], f"{what}: the client was called: {client.calls}"
            print(f"refused {what}: {e}", flush=True)
            continue
        print(f"accepted {what}", flush=True)
        eng.send_weights("v1")  # the bytes the swapped rank sends land in the target
        print(f"sent {what}", flush=True)
        eng.shutdown()
        return


def _chunked_refused(arg: dict, b) -> None:  # noqa: ANN001 - an integrations.Binding
    """`arg["chunked"]`: the trainer path (`integrations.trainer.checked_parts`, what the
    vLLM and SGLang trainer sides run) refuses this rank's chunked plan part for the other
    source rank's identity, and the other rank's part for this identity, in one line
    naming a chunk, before anything is registered."""
    from integrations import trainer

    other = (b.rank + 1) % arg["sources"]
    theirs = rank_tensors(arg["plan"], other).identity
    for rank, ident in ((b.rank, theirs), (other, b.identity)):
        try:
            trainer.checked_parts(arg["plan"], rank, ident, False, None, None, "trainer")
        except IdentityError as e:
            assert "\n" not in str(e) and " chunk " in str(e), str(e)
            print(f"refused chunked rank {rank}: {e}", flush=True)
            continue
        raise AssertionError(f"chunked plan rank {rank} accepted identity {ident}")


def _run_source(arg: dict, b) -> None:  # noqa: ANN001 - an integrations.Binding
    """Send `arg["steps"]` steps of the bound tensors (+1 each step after the first): one
    executor, or one per chunk of a chunked plan (`integrations.trainer.load`)."""
    from integrations import trainer

    tensors, rank, ident = b.tensors, b.rank, b.identity
    if arg.get("swap"):
        _refused(arg, tensors, rank, ident)
        return
    chunked, _ = trainer.checked_parts(arg["plan"], rank, ident, False, None, b, "trainer")
    assert chunked == bool(arg.get("chunked")), f"chunked plan: {chunked}"
    if chunked:
        _chunked_refused(arg, b)
    loaded = trainer.load(arg["plan"], rank, tensors, chunked, executor.LoadOptions(
        identity=ident, transport="nixl", rendezvous=_store(arg), timeout_s=120))
    for step in range(arg["steps"]):
        if step:
            with torch.no_grad():
                for t in tensors.values():
                    t.add_(1)
        if chunked:
            sent = sum(s.bytes for s in executor.run_chunks(loaded))
        else:
            sent = executor.run(loaded).bytes
        print(f"{arg['role']} {arg['index']}: plan rank {rank} step {step} sent "
              f"{sent} bytes", flush=True)


def megatron_source(arg: dict) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    import integrations.megatron
    from tests.support.megatron import build, patch_cuda, patch_mla

    cfg, spec = load(arg["config"])
    src, hf = cfg.source, arg["hf"]
    patch_cuda()
    if hf["model_type"] == "deepseek_v3":
        patch_mla()
    ps.initialize_model_parallel(src.tp, src.pp, virtual_pipeline_model_parallel_size=(
        src.vpp if src.vpp > 1 else None), expert_model_parallel_size=src.ep,
        expert_tensor_parallel_size=arg.get("etp", src.expert_tp))  # etp 1: dense too
    with contextlib.suppress(Exception):
        model_parallel_cuda_manual_seed(0)
    p, rank = ps.get_pipeline_model_parallel_rank(), dist.get_rank()
    vocab = megatron.padded_vocab(spec.dims.vocab, src)
    chunks = [build(hf, src, vocab, p == 0 and v == 0, p == src.pp - 1 and v == src.vpp - 1,
                    vp_stage=v if src.vpp > 1 else None) for v in range(src.vpp)]
    # Megatron's own global layer numbers must be the layers our layout gives each chunk
    got = [[m.layer_number - 1 for m in c.decoder.layers] for c in chunks]
    want = [list(r) for r in megatron.chunk_layers(spec.dims.num_layers, src)[p]]
    assert got == want, f"chunk layers: Megatron {got}, layout {want}"
    ours = materialize(build_layout(spec, src), _full(spec, 0), ranks=[rank])[rank]
    live = {f"model{v}.{n}" if src.vpp > 1 else n: t for v, c in enumerate(chunks)
            for n, t in [*c.named_parameters(), *c.named_buffers()]}
    with torch.no_grad():
        for name, t in ours.items():
            live[name].copy_(t)
    if arg.get("float16_module"):  # bf16 parameters, as under mixed precision
        for c in chunks:
            c.config.bf16 = True
        chunks = [Float16Module(c.config, c) for c in chunks]
    b = integrations.megatron.bind(arg["plan"], chunks)
    assert b.rank == rank, f"Megatron rank {rank} got plan rank {b.rank}"
    if arg.get("vllm_swap"):
        return _vllm_swapped(arg, b)
    _run_source(arg, b)


def fsdp2_source(arg: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import integrations.fsdp2
    from tests.support.hf import load_full

    cfg, spec = load(arg["config"])
    src = cfg.source
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**arg["hf"])).float()
    load_full(model, _full(spec, 0))
    mesh = None
    if src.dp_replicate > 1:
        mesh = init_device_mesh("cpu", (src.dp_replicate, src.dp),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    b = integrations.fsdp2.bind(arg["plan"], model)
    assert b.rank == dist.get_rank(), f"rank {dist.get_rank()} got plan rank {b.rank}"
    if arg.get("vllm_swap"):
        return _vllm_swapped(arg, b)
    _run_source(arg, b)


def _untouched(arg: dict, tensors: dict[str, torch.Tensor]) -> None:
    """`arg["rendezvous"]`: the plan's own store, which a trainer rank hosts; once the test
    sets `sources_done` in its store, report whether anything was written (every tensor is
    still zero) and exit, whether or not the load ever got its peers."""
    import threading

    def watch() -> None:
        store = _store(arg)
        while not store.check(["sources_done"]):  # the sources' imports may take minutes
            time.sleep(0.5)
        written = [n for n, t in tensors.items() if bool(t.any())]
        print(f"target {'written' if written else 'untouched'}: {len(written)} of "
              f"{len(tensors)} tensors changed {written[:3]}", flush=True)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def target(arg: dict) -> None:
    cfg, spec = load(arg["config"])
    rank = arg["index"] + cfg.source.world
    rt = rank_tensors(arg["plan"], rank)
    tensors = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in rt.tensors}
    if arg.get("rendezvous"):  # the vLLM trainer path's store: a step, or nothing written
        _untouched(arg, tensors)
        try:
            executor.run(executor.load(arg["plan"], rank=rank, tensors=tensors,
                                       identity=rt.identity, transport="nixl",
                                       rendezvous=arg["rendezvous"],
                                       timeout_s=arg["timeout_s"]))
        except Exception as e:  # noqa: BLE001 - no peer came: reported, the watcher decides
            print(f"target: {type(e).__name__}: {str(e)[:200]}", flush=True)
        while True:  # the watcher reports and exits once the sources are done
            time.sleep(1)
    layout = build_layout(spec, cfg.target)
    got = [(t.name, t.shape) for t in rt.tensors]
    want = [(t.name, t.shape) for t in layout.ranks[arg["index"]].tensors]
    if arg.get("chunked"):  # the union of the chunks' tensors, in the order they are used
        got, want = sorted(got), sorted(want)
    assert got == want, f"rank_tensors {got[:3]}..., the layout {want[:3]}..."
    o = executor.LoadOptions(identity=rt.identity, transport="nixl", rendezvous=_store(arg),
                             timeout_s=120)
    if arg.get("chunked"):  # every chunk through one buffer, switched into `tensors`
        shadow = executor.ChunkedShadow.load(arg["plan"], rank, tensors, o)
        assert len(shadow.chunks) > 1, f"{len(shadow.chunks)} chunk(s)"
    else:
        ex = executor.load(arg["plan"], rank, tensors, o)
    for step in range(arg["steps"]):
        if arg.get("chunked"):
            shadow.run()
            assert shadow.switched == len(shadow.chunks), f"step {step}: torn"
        else:
            assert executor.run(ex).complete, f"step {step} incomplete"
        want = materialize(layout, _full(spec, step), ranks=[arg["index"]])[arg["index"]]
        bad = [n for n, t in tensors.items() if not torch.equal(t, want[n])]
        assert not bad, f"step {step}: {len(bad)} tensors differ, e.g. {bad[:3]}"
        print(f"target {arg['index']}: plan rank {rank} step {step}: {len(tensors)} tensors "
              "bit-exact", flush=True)


def main() -> int:
    arg = json.loads(sys.argv[1])
    if arg["role"] != "target":
        # the sources' group through the test's store (no port found free ahead of time)
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo/", _store(arg)),
                                rank=arg["index"], world_size=arg["sources"])
    {"megatron": megatron_source, "fsdp2": fsdp2_source, "target": target}[arg["role"]](arg)
    if arg["role"] != "target":
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
