"""CUDA IPC transport: GPUs of one host, peer copies over NVLink/PCIe.

Each rank exports a CUDA IPC handle per region once (`ipc_regions.IpcHandle`, msgpack on
the wire, never pickle); a peer opens it with `UntypedStorage._new_shared_cuda(...)`. A
stage's writes to one peer are one batch (`fuse_batches`), prepared once into raw (dst, src,
nbytes) pointer triples, writes adjacent in memory on both sides merged into one. A batch
into a peer on another GPU is one `cuMemcpyBatchAsync` on the copy engines (`memcpy_batch`,
on that peer's stream). Other batches are one launch of the copy kernel (`copy_kernel.py`,
on the SMs), captured as a CUDA graph; a kernel of this device cannot write memory torch
mapped in the owner device's context, so with the kernel on, a peer on another GPU has its
handles opened here (`cudaIpcOpenMemHandle`, `PeerRegion`, as NCCL maps its peers). With
`copy_kernel: false`, where neither exists, or for large writes, the triples split into
branches of near-equal bytes on the copy engines: a batch of small copies, or one into a
peer on this GPU whose every copy is long (`engines_min_bytes`), as one CUDA graph of up to
`CudaIpcOptions.graph_branches` branches, one of large copies (up to `streams` branches) as one
`cudaMemcpyAsync` per triple through ctypes on the libcudart torch loaded; without that
library, or if the raw call fails, as torch copies (`torch_copy.py`). Which of these a post
takes is one field, the posting mode (`ipc_modes.Mode`); a failure moves it down through
`ipc_modes.Ladder.degrade`, which records why (`degraded`). Posts queue after the caller's
current stream (`ordered_posts`: packs need no host wait); a batch has landed when its CUDA
event has. A post is runtime calls on raw handles made at prepare. Notifications go through
shared memory (`shm_mailbox.py`); a stage's DONE can leave from the GPU (`notify_landed`,
`ipc_signals.py`). What each path costs: BENCHMARKS.md.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..gpu.copy_kernel import CopyKernel
from ..gpu.cuda_runtime import NOT_READY, BatchCopies, Runtime, current_raw_stream
from ..gpu.graphs import capturing, device_sync
from .base import Capabilities, Store, WriteBatch, batch_copies
from .ipc_modes import Ladder, Mode
from .ipc_posted import FastPost, Posted, branches
from .ipc_regions import (
    IpcHandle,
    PeerRegion,
    export_region,
    import_region,
    peer_handles,
    raw_handle,
    segment,
)
from .ipc_signals import DeviceSignals
from .options import CudaIpcOptions
from .shm_mailbox import ShmMailbox
from .torch_copy import prepare_copies


class CudaIpcTransport:
    capabilities = Capabilities(ordered_posts=True, graph_ops=True, fuse_batches=True,
                                notify_landed=True)
    """A stage's writes to one peer are one batch, posted after the caller's queued kernels;
    its DONE may leave from the GPU; `graph_ops` as `CudaIpcOptions.graphs` says."""

    def __init__(self, rank: int, namespace: str, store: Store, device: torch.device,
                 options: CudaIpcOptions | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"rank {rank}: transport 'cuda_ipc' needs CUDA tensors, got "
                             f"{device}; use 'nixl' or 'local' for CPU tensors")
        self.rank, self.ns, self.store, self.device = rank, namespace, store, device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.options = opts = options or CudaIpcOptions()
        self.capabilities = replace(CudaIpcTransport.capabilities, graph_ops=opts.graphs)
        self.streams = [torch.cuda.Stream(device) for _ in range(max(1, opts.streams))]
        self.prepared = 0
        self.peers: dict[int, list[torch.Tensor]] = {}
        self.mailbox = ShmMailbox(rank, namespace)
        self.poll = self.mailbox.poll  # a wait polls in a loop: one call less each time
        self.rt = Runtime.load()
        self.segments: list[int] = []  # allocation base of each region (set by export)
        self.peer_segments: dict[int, list[int]] = {}
        self.ncopies = 0  # device copies per step (after merging), for benchmarks
        self.regions: list[torch.Tensor] = []
        self.current_raw = current_raw_stream() if self.rt is not None else None
        """The caller's current stream as a raw handle (posts through the runtime), or None."""
        self.kernel = CopyKernel.load(device) if opts.copy_kernel and self.rt else None
        """The batched copy kernel (`copy_kernel.py`), or None: copy engines only."""
        self.ladder = Ladder.at_start(rank, opts.copy_kernel, self.rt is not None,
                                      self.current_raw is not None, self.kernel is not None)
        """The posting mode (`ladder.mode`), whether the kernel is used, and why not."""
        self.opened: dict[int, list[int]] = {}
        """Peer -> the bases this rank opened itself (`PeerRegion`s), one per distinct handle."""
        self.counters: dict[int, list[tuple[bytes, int, int]]] = {}
        """Peer -> torch's IPC reference counters of the regions opened here (released at
        close, as torch's own import does when its storage dies: until then the peer's
        torch keeps each exported block alive)."""
        self.kernel_batches = 0
        self.engine_graphs = 0  # batches posted as one CUDA graph of copy-engine copies
        self.batch_api = BatchCopies.load() if self.rt is not None and opts.memcpy_batch \
            else None
        """`cuMemcpyBatchAsync` for batches into a peer on another GPU, or None."""
        self.api_batches = 0
        self.signals = DeviceSignals.load(rank, device, self.rt, self.mailbox) \
            if self.rt is not None and opts.device_signals else None
        """DONE published by the GPU (`ipc_signals.py`), or None: by the host."""

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions

    def export(self) -> dict[str, Any]:
        handles = [export_region(r) for r in self.regions]
        self.segments = [segment(r, h.offset) for r, h in zip(self.regions, handles)]
        return {"regions": [h.to_msgpack() for h in handles], "mailbox": self.mailbox.export()}

    @property
    def degraded(self) -> list[tuple[str, str]]:
        """(what was turned off, why), in order: at start and after a failed call."""
        return list(self.ladder.degraded)

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        handles = peer_handles(peer, desc)  # every field checked before any use
        self._close_peer(peer)
        if self.signals is not None:  # no stream write may still target a ring replaced
            self.signals.forget(peer)
        self.mailbox.import_peer(peer, desc["mailbox"])
        if self._open_here(peer, handles):
            return
        self.peers[peer] = [import_region(h) for h in handles]
        self.peer_segments[peer] = [segment(r, h.offset) for r, h in
                                    zip(self.peers[peer], handles)]
        regs = self.peers[peer]
        if regs and regs[0].device != self.device:  # torch enables peer access both ways
            a = torch.zeros(1, dtype=torch.uint8, device=self.device)
            b = torch.zeros(1, dtype=torch.uint8, device=regs[0].device)
            b.copy_(a)  # this device may now access the peer's (what the raw copies need)
            a.copy_(b)
            device_sync(regs[0].device)

    def _open_here(self, peer: int, handles: list[IpcHandle]) -> bool:
        """Open the regions of a peer on another GPU in this device's context (for the copy
        kernel); False where that does not apply (same GPU, no kernel, no runtime, handles
        only torch opens) or fails: torch opens them then, for the copy engines."""
        raws = [raw_handle(h.handle) for h in handles]
        if not self.ladder.kernel or not handles or None in raws or \
                any(h.device == self.device.index for h in handles):
            return False
        by_handle: dict[bytes, int] = {}  # regions of one allocation share its handle
        try:
            with torch.cuda.device(self.device):
                for h in raws:
                    if h not in by_handle:
                        by_handle[h] = self.rt.open_handle(h)  # type: ignore[index]
        except RuntimeError as e:
            self._close_bases(list(by_handle.values()))
            warnings.warn(f"rank {self.rank}: could not map peer {peer}'s memory on "
                          f"{self.device} ({e}); its batches go to the copy engines",
                          stacklevel=3)
            return False
        bases = [by_handle[h] for h in raws]  # type: ignore[index]
        self.opened[peer] = list(by_handle.values())
        self.counters[peer] = [(h.ref_handle, h.ref_offset, h.device) for h in handles]
        self.peers[peer] = [PeerRegion(b + h.offset + h.storage_offset, h.numel, h.device)
                            for b, h in zip(bases, handles)]  # type: ignore[misc]
        self.peer_segments[peer] = bases
        return True

    def _close_bases(self, bases: list[int]) -> None:
        """Close mappings this rank opened (one per distinct handle)."""
        if bases and self.ladder.mode >= Mode.RUNTIME:
            with torch.cuda.device(self.device):
                for base in bases:
                    self.rt.ipc_close(base)

    def _close_peer(self, peer: int) -> None:
        bases = self.opened.pop(peer, [])
        self._close_bases(bases)
        if bases:
            self.peers.pop(peer, None)
        for handle, offset, device in self.counters.pop(peer, []):
            try:  # else the peer's torch holds every exported block until it exits
                torch.UntypedStorage._release_ipc_counter(handle, offset, device=device)
            except Exception as e:  # noqa: BLE001 - the peer may be gone: nothing to keep
                warnings.warn(f"rank {self.rank}: could not release peer {peer}'s IPC "
                              f"counter ({e})", stacklevel=2)
                break

    def _torch_peer(self, peer: int) -> list[torch.Tensor]:
        if peer in self.opened:
            raise RuntimeError(f"rank {self.rank}: a CUDA runtime call failed for a batch into "
                               f"peer {peer}, whose memory this rank mapped itself; there is "
                               "no torch path for it (set copy_kernel: false to use torch's)")
        return self.peers[peer]

    def prepare(self, batch: WriteBatch) -> Posted:
        stream = self.streams[self.prepared % len(self.streams)]
        self.prepared += 1
        if self.ladder.mode is Mode.TORCH:
            return Posted(batch, prepare_copies(self.regions, self._torch_peer(batch.peer),
                                                 batch), stream)
        if len(self.segments) != len(self.regions):
            self.export()
        d, s, n = batch_copies(self.regions, self.peers[batch.peer], batch,
                               np.array(self.segments, dtype=np.int64),
                               np.array(self.peer_segments[batch.peer], dtype=np.int64))
        self.ncopies += len(n)
        handle = Posted(batch, None, stream, list(zip(d.tolist(), s.tolist(), n.tolist())))
        o = self.options
        here = batch.peer in self.opened  # on another GPU, mapped in this context
        limit = o.peer_kernel_max_mean_bytes if here else o.kernel_max_mean_bytes
        if batch.beside_packs:  # the SMs run the next pack group meanwhile
            limit = min(limit, o.beside_packs_max_mean_bytes)
        if self.batch_api is not None and self.ladder.mode is Mode.FAST and len(n) and (here or any(
                r.device != self.device for r in self.peers[batch.peer])):  # copy engines, SMs free
            if o.peer_streams:  # one stream a peer: its batches land in order
                handle.stream = stream = self.streams[sorted(self.peers).index(
                    batch.peer) % len(self.streams)]
            handle.batched = self.batch_api.prepare(d.tolist(), s.tolist(), n.tolist(),
                                                    o.memcpy_batch_first, o.memcpy_batch_most)
            self._plan_posts(handle)  # the posts the batch falls back to
            handle.fast, self.api_batches = FastPost(stream, [], 0), self.api_batches + 1
            return handle
        mine = all(r.device == self.device for r in self.peers[batch.peer])  # this GPU's
        engines = mine and len(n) > 0 and int(n.min()) >= o.engines_min_bytes  # long copies
        if self.ladder.kernel and len(n) and int(n.sum()) < limit * len(n) and \
                (here or mine) and not engines:
            handle.table = self.kernel.table(d, s, n)  # type: ignore[union-attr]
            handle.graph = self._capture_kernel(
                handle.table, o.beside_packs_kernel_share if batch.beside_packs else 1.0)
            self.kernel_batches += handle.graph is not None
        if handle.graph is None and o.graphs and len(n) >= o.graph_min_copies and \
                (engines or int(n.sum()) < o.graph_max_mean_bytes * len(n)):
            handle.graph = self._capture(handle.raw)
            self.engine_graphs += handle.graph is not None
        if handle.graph is None:
            self._plan_posts(handle)
        if self.ladder.mode is Mode.FAST:
            graph_exec = handle.graph.raw_cuda_graph_exec() if handle.graph is not None else 0
            handle.fast = FastPost(stream, handle.sides, graph_exec)
        return handle

    def _plan_posts(self, handle: Posted) -> None:
        """The copies' post order, once: in turn across the branches, so that every copy
        engine starts after one post (branch 0 on the handle's stream)."""
        parts = branches(handle.raw or [], len(self.streams))
        streams = [handle.stream] + [s for s in self.streams if s is not handle.stream]
        handle.sides = streams[1:len(parts)]
        ids = [s.cuda_stream for s in streams]
        handle.order = [(*part[i], ids[b]) for i in range(max(map(len, parts), default=0))
                        for b, part in enumerate(parts) if i < len(part)]

    def _capture(self, raw: list[tuple[int, int, int]]) -> torch.cuda.CUDAGraph | None:
        """The copies of `raw` as one CUDA graph of up to `graph_branches` parallel branches
        (so several copy engines work at once), or None (then they are posted one by one)."""
        graph = torch.cuda.CUDAGraph()
        sides = [torch.cuda.Stream(self.device) for _ in range(self.options.graph_branches)]
        try:
            with capturing(self.device, graph):
                main = torch.cuda.current_stream(self.device)
                parts = branches(raw, len(sides))
                for side, part in zip(sides, parts):
                    side.wait_stream(main)  # fork
                    self._copy(part, side.cuda_stream)
                for side in sides[:len(parts)]:
                    main.wait_stream(side)  # join
        except Exception as e:  # noqa: BLE001 - any capture failure: post copies instead
            warnings.warn(f"rank {self.rank}: cuda_ipc could not capture a batch as a CUDA "
                          f"graph ({e}); it posts its copies one by one", stacklevel=2)
            device_sync(self.device)
            return None
        return graph

    def _capture_kernel(self, table: torch.Tensor, share: float) -> torch.cuda.CUDAGraph | None:
        """One launch of the copy kernel over `table` (a grid of `share` of the device) as
        a CUDA graph, or None."""
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(self.device, graph):
                self.kernel.launch(table, share)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - the copy engines instead
            self.ladder.degrade("copy_kernel", f"capturing it as a CUDA graph failed: {e}")
            device_sync(self.device)
            return None
        return graph

    def _copy(self, raw: list[tuple[int, int, int]], stream: int) -> None:
        fn, kind = self.rt.memcpy_async, Runtime.D2D  # type: ignore[union-attr]
        for d, s, n in raw:
            if fn(d, s, n, kind, stream):
                raise RuntimeError(f"cudaMemcpyAsync error {self.rt.last_error()}")  # type: ignore[union-attr]

    def post(self, handle: Posted) -> None:
        handle.fast_posted = False
        if self.ladder.mode is Mode.FAST and handle.fast is not None:
            rt, index = self.rt, self.index  # what `Runtime.on` does, without its generator
            prev = rt.device()  # type: ignore[union-attr] # Mode.FAST has rt
            if prev != index:
                rt.set_device(index)  # type: ignore[union-attr]
            try:
                fast = self._post_fast(handle)
            finally:
                if prev != index and prev >= 0:
                    rt.set_device(prev)  # type: ignore[union-attr]
            if fast:
                handle.posted = handle.fast_posted = True
                return
        stream = handle.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if handle.raw is not None and self.ladder.mode is Mode.TORCH:  # the raw path failed
            self._as_torch(handle)
        if handle.graph is not None and self.ladder.mode >= Mode.RUNTIME:
            with torch.cuda.stream(stream):
                handle.graph.replay()
        elif handle.raw is not None:
            self._post_raw(handle)
        if handle.ops:
            with torch.cuda.stream(stream):
                for op in handle.ops:
                    op()
        handle.event.record(stream)
        handle.posted = True

    def _post_raw(self, handle: Posted) -> None:
        """The copies one `cudaMemcpyAsync` each, spread over the copy streams (joined back
        into the handle's stream, whose event says when all have landed)."""
        for side in handle.sides:
            side.wait_stream(handle.stream)
        fn, kind = self.rt.memcpy_async, Runtime.D2D  # type: ignore[union-attr]
        for d, s, n, stream in handle.order:
            if fn(d, s, n, kind, stream):
                code = self.rt.last_error()  # type: ignore[union-attr] # clear it for torch
                self.ladder.degrade("runtime", f"cudaMemcpyAsync failed (error {code})")
                self._as_torch(handle)  # the whole batch again: idempotent
                break
        for side in handle.sides:
            handle.stream.wait_stream(side)

    def _post_fast(self, handle: Posted) -> bool:
        """The post as a few runtime calls on raw handles (cheap host calls, where torch's
        stream context managers and `wait_stream` cost far more a batch); False if one
        failed (it is then posted the torch way, whole: idempotent)."""
        rt, f = self.rt, handle.fast
        assert rt is not None and f is not None and self.current_raw is not None  # Mode.FAST
        cur = self.current_raw(self.index)
        bad = rt.event_record(f.ready, cur) or rt.wait_event(f.stream, f.ready, 0)
        if not bad and f.graph_exec:
            bad = rt.graph_launch(f.graph_exec, f.stream)
        elif not bad and handle.batched is not None:
            bad = self.batch_api.post(handle.batched, f.stream)  # type: ignore[union-attr]
        elif not bad:
            fn, kind = rt.memcpy_async, Runtime.D2D
            for side in f.side_streams:
                bad = bad or rt.wait_event(side, f.ready, 0)
            for d, s, n, stream in handle.order:
                bad = bad or fn(d, s, n, kind, stream)
            for side, ev in zip(f.side_streams, f.sides):
                bad = bad or rt.event_record(ev, side) or rt.wait_event(f.stream, ev, 0)
        bad = bad or rt.event_record(f.done, f.stream)
        if bad:
            code = rt.last_error()  # clear it: torch would report it later
            self.ladder.degrade("fast_post", f"a CUDA runtime call failed (error {bad}, {code})")
            return False
        return True

    def _as_torch(self, handle: Posted) -> None:
        """Turn a raw batch into torch copies (after a raw call failed)."""
        handle.ops = prepare_copies(self.regions, self._torch_peer(handle.batch.peer),
                                    handle.batch)
        handle.raw, handle.graph, handle.order = None, None, []

    def done(self, handle: Posted) -> bool:
        if handle.fast_posted and self.ladder.mode >= Mode.RUNTIME:
            code = self.rt.event_query(handle.fast.done)  # type: ignore[union-attr]
            if code and code != NOT_READY:
                raise RuntimeError(f"rank {self.rank}: CUDA error {code} in a batch's copies")
            return not code
        return not handle.posted or handle.event.query()

    def notify(self, peer: int, msg: bytes) -> None:
        self.mailbox.notify(peer, msg)

    def notify_landed(self, handles: list[Posted], peer: int, msg: bytes) -> bool:
        """Send `msg` to `peer` from the GPU once every batch of `handles` has landed (each
        posted by `post`, not yet known landed here); False where this cannot be done (then
        the caller notifies from the host once `done` says they landed)."""
        if self.ladder.mode is Mode.TORCH or self.signals is None or \
                not all(h.fast_posted for h in handles):
            return False
        return self.signals.after([h.fast.done for h in handles],  # type: ignore[union-attr]
                                  peer, msg)

    def poll(self) -> list[tuple[str, bytes]]:
        return self.mailbox.poll()

    def peer_id(self, peer: int) -> str:
        return self.mailbox.peer_id(peer)

    def release(self, handle: Posted) -> None:
        handle.graph, handle.fast = None, None  # the raw graph exec dies with the graph
        handle.table = handle.batched = None

    def stats(self) -> dict[str, int]:
        mode = self.ladder.mode
        return {"device_copies": self.ncopies, "raw_copies": int(mode >= Mode.RUNTIME),
                "posting_mode": int(mode), "degraded": len(self.ladder.degraded),
                "kernel_batches": self.kernel_batches, "batch_api_batches": self.api_batches,
                "engine_graphs": self.engine_graphs,
                "peers_mapped_here": len(self.opened),
                "handles_opened_here": sum(map(len, self.opened.values())),
                "regions_mapped_here": sum(len(self.peers.get(p, ())) for p in self.opened),
                "device_signals": self.signals.sent if self.signals is not None else 0}

    def close(self) -> None:
        for stream in self.streams:
            stream.synchronize()
        if self.signals is not None:
            self.signals.settle()
        for peer in list(self.opened):
            self._close_peer(peer)
        self.peers.clear()
        self.mailbox.close()
