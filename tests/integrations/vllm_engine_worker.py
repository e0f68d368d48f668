"""One vLLM 0.33 worker on CPU with the `rdma_plan` weight-transfer engine.

argv[1] is JSON: {"gloo": file:// init method, "control": port, "cases": [{"name", "hf", "tp", "ep",
"folder", ...}]}. Per case (both workers together, over gloo): build the real VllmConfig
(`weight_transfer_config=WeightTransferConfig(backend="rdma_plan")`), the model for this
rank (`load_format="dummy"`, then vLLM's post-load processing, PWAL), and the engine
through `WeightTransferEngineFactory.create_engine`, as `Worker.load_model` does; then
serve the store RPCs of `vllm_cases.StoreClient` with `Shim`, a copy of the weight-transfer
methods of vLLM's `Worker` (gpu_worker.py), until "done".

`check` (an extra RPC of the test) compares every parameter, buffer and MLA
`W_UK_T`/`W_UV` of the live model, bit for bit, with vLLM's own reference: a fresh model of
the same config that loaded the version's checkpoint through `load_weights` and then ran
PWAL; and every `data_ptr` with the one before the first update.

Neutralised on CPU by `tests.support.vllm_cpu_build.patch_cpu` (LAYOUTS.md):
`torch.accelerator.empty_cache`; the kernel steps of PWAL that need `vllm._C` or a GPU
kernel: the CPU MoE experts' prepack and the block-FP8 linear kernel (they re-lay weights
out for a kernel; MLA's W_UK_T/W_UV step runs for real).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from tests.integrations import vllm_cases  # noqa: E402
from tests.support import vllm_cpu_build  # noqa: E402
from tests.support.vllm_cpu_build import KEEP  # noqa: E402, F401  (the refusal worker's)


def engine_config(case: dict, rank: int):  # noqa: ANN201 (vLLM's type)
    from vllm.config import WeightTransferConfig

    folder = tempfile.mkdtemp(prefix="vllm-engine-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(case["hf"], f)
    return vllm_cpu_build.engine_config(
        folder, case["tp"], ep=case["ep"], rank=rank,
        weight_transfer_config=WeightTransferConfig(backend="rdma_plan"))


def reference(case: dict, rank: int, seed: int) -> torch.nn.Module:
    """vLLM's own post-load state for version `seed`: a fresh model, `load_weights` of the
    checkpoint, then PWAL once."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import base_loader, get_model
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cfg = engine_config(case, rank)
    with set_current_vllm_config(cfg):
        pwal, base_loader.process_weights_after_loading = \
            base_loader.process_weights_after_loading, lambda *a, **k: None
        try:
            model = get_model(vllm_config=cfg)
        finally:
            base_loader.process_weights_after_loading = pwal
        KEEP.append(model)
        model.load_weights(iter(vllm_cases.checkpoint(case["hf"], seed).items()))
        process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from integrations.vllm_checks import mla_modules
    from integrations.vllm_content import live_tensors

    out = dict(live_tensors(model))
    for prefix, m in mla_modules(model).items():
        out |= {f"{prefix}.{a}": getattr(m, a) for a in ("W_UK_T", "W_UV")}
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    errors = [f"{n}: missing" for n in want if n not in got]
    errors += [f"{n}: not in the reference" for n in got if n not in want]
    for n in sorted(want.keys() & got.keys()):
        g, w = got[n], want[n]
        if g.shape != w.shape or g.dtype != w.dtype:
            errors.append(f"{n}: {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {w.dtype}")
        elif not torch.equal(_bits(g), _bits(w)):
            errors.append(f"{n}: {int((_bits(g) != _bits(w)).sum())} bytes differ")
    return errors


class Shim:
    """The weight-transfer methods of vLLM 0.33's `Worker` (v1/worker/gpu_worker.py), same
    order and session rules, plus the test's `check` and `skip_refresh`."""

    def __init__(self, case: dict, rank: int, cfg, model, engine) -> None:  # noqa: ANN001
        from integrations.vllm_content import pointers

        self.case, self.rank, self.cfg, self.model, self.engine = case, rank, cfg, model, engine
        self.active, self.ptrs, self.saved = False, {}, None
        self.expect: tuple[str, int | None] | None = None  # shadow mode: (label, seed)
        self.raised: list[str] = []  # the calls that raised here since the last check
        self.pointers = pointers

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))
        self.ptrs = self.pointers(self.model)

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        before = None
        if self.expect is not None and self.expect[1] is None:  # no reference: the state
            before = {n: t.clone() for n, t in state(self.model).items()}  # before it
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise
        if self.expect is not None:  # shadow mode: returned while the bytes land elsewhere
            label, seed = self.expect
            want = before if seed is None else state(reference(self.case, self.rank, seed))
            out = {"errors": compare(state(self.model), want), "compared": len(want)}
            store.set(f"{self.case['name']}/during/{self.rank}/{label}", json.dumps(out))
            self.expect = None

    def expect_live(self, label: str, seed: int | None) -> None:
        """Shadow mode: after the next `update_weights` returns, the live weights must still
        be version `seed` (None: what they were before the call)."""
        self.expect = (label, seed)

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching "
                               "start_weight_update.")
        self.engine.finish_weight_update()
        self.active = False

    def skip_refresh(self, skip: bool) -> None:
        """Negative control: the next finish runs no derived-state refresh."""
        if skip:
            self.saved, self.engine.refresh = self.engine.refresh, []
        elif self.saved is not None:
            self.engine.refresh, self.saved = self.saved, None

    def timeout(self, s: float) -> None:
        """How long this worker's chunks wait for their peers (a torn chunk's wait)."""
        for ex in self.engine.core.chunked.chunks:
            ex.timeout_s = s

    def check(self, label: str, seed: int, torn: bool = False, new_seed: int | None = None
              ) -> None:
        """The live weights against vLLM's reference of version `seed`; `new_seed`: a torn
        chunked update of that version, whose chunk 0 alone was switched (`torn_chunks`)."""
        from dataclasses import asdict

        from integrations.errors import TornUpdateError

        chunked = self.engine.core.chunked if self.engine.core is not None else None
        out = {"weight_version": self.engine.weight_version,
               "chunks": 0 if chunked is None else chunked.switched,
               "of_chunks": 0 if chunked is None else len(chunked.chunks),
               "shadow": [asdict(u) for u in getattr(self.engine, "shadow_updates", [])],
               "refreshes": self.engine.refreshes, "derived": len(self.engine.refresh),
               "raised": self.raised,
               "moved": [n for n, p in self.pointers(self.model).items()
                         if self.ptrs.get(n) != p]}
        if torn:  # a caller that ignores the update's error: finish must refuse too
            try:
                self.engine.finish_weight_update()
                out["finish"] = "returned"
            except TornUpdateError as e:
                out["finish"] = str(e)
        self.raised = []
        ref = reference(self.case, self.rank, seed)
        out["errors"] = compare(state(self.model), state(ref))
        out["compared"] = len(state(ref))
        out["identity"] = self.engine.identity
        if new_seed is not None:
            out["torn_chunks"] = self.torn_chunks(state(ref), new_seed)
        store.set(f"{self.case['name']}/check/{self.rank}/{label}", json.dumps(out))

    def torn_chunks(self, old: dict[str, torch.Tensor], new_seed: int) -> dict:
        """Chunk 0's tensors and the later chunks' (the plan's regions), those of chunk 0
        that differ from version `new_seed`, and those of the later chunks that differ from
        `old`, the last whole version."""
        from schemas.plan import STAGING

        chunks = [[g.name for g in rp.regions if g.name != STAGING]
                  for _, rp in self.engine.core.parts]
        later = [n for chunk in chunks[1:] for n in chunk]
        live, new = state(self.model), state(reference(self.case, self.rank, new_seed))

        def differ(names: list[str], want: dict[str, torch.Tensor]) -> list[str]:
            return compare({n: live[n] for n in names}, {n: want[n] for n in names})
        return {"chunk0": chunks[0], "later": later,
                "chunk0_not_new": differ(chunks[0], new), "later_not_old": differ(later, old)}


store = None


def serve(case: dict, rank: int) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, initialize_model_parallel
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import get_model

    cfg = engine_config(case, rank)
    with set_current_vllm_config(cfg):
        initialize_model_parallel(tensor_model_parallel_size=case["tp"])
        try:
            model = get_model(vllm_config=cfg)  # dummy weights, then PWAL
            KEEP.append(model)
            engine = WeightTransferEngineFactory.create_engine(
                cfg.weight_transfer_config, cfg, torch.device("cpu"), model)
            shim, seq = Shim(case, rank, cfg, model, engine), 0
            store.set(f"{case['name']}/built/{rank}", b"1")  # trainers load the plan now
            while True:
                msg = json.loads(store.get(f"{case['name']}/rpc/{rank}/{seq}"))
                if msg["method"] == "done":
                    engine.shutdown()
                    break
                try:
                    getattr(shim, msg["method"])(**msg["kwargs"])
                    err = ""
                except Exception as e:  # noqa: BLE001 - sent back to the client
                    err = f"worker {rank} {type(e).__name__}: {e}"
                    shim.raised.append(msg["method"])
                    if msg["method"] == "check":
                        err += traceback.format_exc()
                store.set(f"{case['name']}/reply/{rank}/{seq}", json.dumps({"error": err}))
                seq += 1
        finally:
            destroy_model_parallel()


def main() -> None:
    global store
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from integrations.vllm import register

    vllm_cpu_build.patch_cpu()
    register()
    register()  # idempotent (vLLM's registry raises on duplicates)
    store = vllm_cases.open_control(arg["control"])
    vllm_cpu_build.init_distributed(world, rank, arg["gloo"])
    for case in arg["cases"]:
        serve(case, rank)
        print(f"worker {rank}: {case['name']} done", flush=True)


if __name__ == "__main__":
    main()
