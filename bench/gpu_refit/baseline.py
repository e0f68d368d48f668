"""The baseline most RL frameworks use: 1 GiB buckets, all-gather, broadcast, slice."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.gpu_refit.ctx import Ctx
from bench.gpu_refit.setup import Setup, now


@dataclass
class Bucket:
    nbytes: int = 0
    names: list[str] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
    gathered: list = field(default_factory=list)   # trainers: my non-replicated tensors
    send_bytes: int = 0
    unpack: list = field(default_factory=list)     # trainer 0: (dst view, src view)
    slices: list = field(default_factory=list)     # targets: (dst view, src view)


def _groups(spec, layouts) -> list[list[str]]:
    """Logical tensors that share a physical tensor on any rank of either side, or a
    source tensor name (the same-named shards the trainers all-gather), together."""
    parent = {t.name: t.name for t in spec.tensors}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    seen = set()
    src = layouts[0]  # a tensor the trainers all-gather: every rank's pieces in one bucket
    by_name: dict[str, list[str]] = {}
    for rl in src.ranks:
        for pt in rl.tensors:
            by_name.setdefault(pt.name, []).extend(p.tensor for p in pt.pieces)
    same_name = [(tuple(dict.fromkeys(v)),) for v in by_name.values()]
    for layout in (*layouts, same_name):
        for rl in (layout.ranks if hasattr(layout, "ranks") else [None]):
            for pt in (rl.tensors if rl is not None else layout):
                names = (tuple(dict.fromkeys(p.tensor for p in pt.pieces))
                         if rl is not None else pt[0])
                if len(names) < 2 or names in seen:
                    continue
                seen.add(names)
                for n in names[1:]:
                    a, b = find(names[0]), find(n)
                    if a != b:
                        parent[b] = a
    order = {t.name: i for i, t in enumerate(spec.tensors)}
    groups: dict[str, list[str]] = {}
    for t in spec.tensors:
        groups.setdefault(find(t.name), []).append(t.name)
    return sorted(groups.values(), key=lambda g: order[g[0]])


class Baseline:
    """Bucketed all-gather + broadcast + slice, every view prepared once."""

    ALIGN = 256

    def __init__(self, spec, src, dst, rank: int, tensors: dict, bucket_bytes: int,
                 device, trainers_group, bcast_group, dist, setup: Setup) -> None:
        import torch

        from harness.weights import DTYPES, logical_box, piece_view

        self.rank, self.dist = rank, dist
        trainers = setup.trainers
        self.trainers = trainers
        self.trainers_group, self.bcast_group = trainers_group, bcast_group
        by = spec.by_name
        nbytes = {t.name: t.numel * torch.empty((), dtype=DTYPES[t.dtype]).element_size()
                  for t in spec.tensors}
        buckets, bucket_of = [Bucket()], {}
        for group in _groups(spec, (src, dst)):
            size = sum(-(-nbytes[n] // self.ALIGN) * self.ALIGN for n in group)
            if buckets[-1].nbytes and buckets[-1].nbytes + size > bucket_bytes:
                buckets.append(Bucket())
            b = buckets[-1]
            for n in group:
                b.offsets[n] = b.nbytes
                b.names.append(n)
                b.nbytes += -(-nbytes[n] // self.ALIGN) * self.ALIGN
                bucket_of[n] = len(buckets) - 1
        self.buckets = buckets
        biggest = max(b.nbytes for b in buckets)
        self.is_trainer, self.is_target = rank in trainers, rank in setup.targets
        in_bcast = rank == 0 or self.is_target
        self.buf = torch.empty(biggest, dtype=torch.uint8, device=device) if in_bcast else None

        def full_view(b: Bucket, name: str):
            t = by[name]
            o = b.offsets[name]
            return self.buf[o:o + nbytes[name]].view(DTYPES[t.dtype]).view(t.shape)

        if self.is_trainer:
            mine = src.ranks[rank].tensors
            others = [{pt.name: pt for pt in src.ranks[r].tensors} for r in trainers]
            for pt in mine:
                if not pt.pieces:
                    continue
                b = buckets[bucket_of[pt.pieces[0].tensor]]
                same = all(o.get(pt.name) is not None and o[pt.name].pieces == pt.pieces
                           for o in others)
                if same:
                    if rank == 0:
                        for piece in pt.pieces:
                            b.unpack.append((logical_box(full_view(b, piece.tensor), piece),
                                             piece_view(tensors[pt.name], piece)))
                    continue
                for o in others:
                    peer = o.get(pt.name)
                    if peer is None or peer.shape != pt.shape or peer.dtype != pt.dtype:
                        raise ValueError(f"baseline: {pt.name} differs in shape across "
                                         "trainers; cannot all-gather it")
                t = tensors[pt.name]
                b.gathered.append((pt, b.send_bytes, t.reshape(-1).view(torch.uint8)))
                b.send_bytes += t.numel() * t.element_size()
            most = max(b.send_bytes for b in buckets)
            self.send = torch.empty(max(most, 1), dtype=torch.uint8, device=device)
            self.recv = torch.empty(max(most, 1) * len(trainers), dtype=torch.uint8,
                                    device=device)
            if rank == 0:
                for b in buckets:
                    for pt, off, _ in b.gathered:
                        for r in trainers:
                            peer_pt = others[r][pt.name]
                            nb = pt.numel * torch.empty((), dtype=DTYPES[pt.dtype]).element_size()
                            base = r * b.send_bytes + off
                            phys = self.recv[base:base + nb].view(DTYPES[pt.dtype]).view(
                                pt.shape)
                            for piece in peer_pt.pieces:
                                b.unpack.append((logical_box(full_view(b, piece.tensor), piece),
                                                 piece_view(phys, piece)))
        if self.is_target:
            for pt in dst.ranks[rank - len(trainers)].tensors:
                for piece in pt.pieces:
                    b = buckets[bucket_of[piece.tensor]]
                    b.slices.append((piece_view(tensors[pt.name], piece),
                                     logical_box(full_view(b, piece.tensor), piece)))
        self.copies = sum(len(b.unpack) + len(b.slices) for b in buckets)

    def step(self, gather: bool = True, bcast: bool = True, local: bool = True) -> None:
        import torch

        dist = self.dist
        for b in self.buckets:
            if self.is_trainer and gather and b.send_bytes:
                n = b.send_bytes
                torch.cat([u8 for _, _, u8 in b.gathered], out=self.send[:n])
                out = self.recv[:n * len(self.trainers)]
                if hasattr(dist, "all_gather_into_tensor") and out.is_cuda:
                    dist.all_gather_into_tensor(out, self.send[:n], group=self.trainers_group)
                else:
                    dist.all_gather(list(out.chunk(len(self.trainers))), self.send[:n],
                                    group=self.trainers_group)
            if self.rank == 0 and local:
                for d, s in b.unpack:
                    d.copy_(s)
            if self.buf is not None and bcast:
                dist.broadcast(self.buf[:b.nbytes], src=0, group=self.bcast_group)
            if self.is_target and local:
                for d, s in b.slices:
                    d.copy_(s)


def run_baseline(ctx: Ctx, model: str, spec, src, dst, tensors: dict, out: dict, verify,
                 seed: int) -> None:
    args, rank = ctx.args, ctx.rank
    t0 = now()
    base = Baseline(spec, src, dst, rank, tensors, args.bucket_mib << 20, ctx.device,
                    ctx.trainers, ctx.bcast, ctx.dist, ctx.setup)
    if rank == 0:
        print(f"[{model}] baseline: {len(base.buckets)} buckets of <= {args.bucket_mib} MiB, "
              f"prepared in {now() - t0:.1f} s", flush=True)
    res = ctx.timed(base.step, max(1, args.warmup), args.baseline_steps or args.steps)
    res["bit_exact"] = verify("NCCL baseline", seed)
    res["buckets"] = len(base.buckets)
    res["copies_per_rank"] = ctx.gather(base.copies)
    out["methods"]["NCCL baseline"] = res
    ctx.profile(base.step, f"{model} NCCL baseline", steps=2)
    parts = {}
    for name, kw in (("broadcast only", dict(gather=False, local=False)),
                     ("all-gather only", dict(bcast=False, local=False)),
                     ("local copies only", dict(gather=False, bcast=False))):
        parts[name] = ctx.timed(lambda kw=kw: base.step(**kw), 1, args.part_steps)
    out["baseline_parts"] = parts
    base.__dict__.clear()  # free its buffers and views now
