"""Where every plan rank sits: host, GPU, NIC. Sources are plan ranks 0..S-1, targets S..S+T-1.

disaggregated: source rank i on host i // g, GPU i % g; target j on the hosts after them.
colocated: every host gives its first `source_gpus_per_host` GPUs (default g/2) to sources
and the rest to targets. A GPU uses the NIC that serves it; writes between two GPUs of one
host go over NVLink and load no NIC. A write costs its link a fixed time beyond its bytes
(`NIC_WRITE_S`, `NVLINK_WRITE_S`): the compiler balances by it, the simulator charges it.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.config import ClusterConfig, ConfigError

NIC_WRITE_S = 10e-9
"""Link time of one RDMA write beyond its bytes (work request fetch and headers)."""
NVLINK_WRITE_S = 20e-9
"""Link time of one peer write beyond its bytes, between two GPUs: `cuda_ipc` copies a
batch with one kernel that writes over NVLink (`executor/transports/cuda_ipc.py`), where
thousands of 1 MiB writes take as long as a few large ones of the same bytes
(`bench/executor_bench.py`; BENCHMARKS.md, "Microbenchmarks on GPUs"). The copy engines,
which batches of writes averaging 32 MiB or more still take, cost microseconds a write:
at that size a small share of a write's bytes."""


@dataclass(frozen=True, slots=True)
class Topology:
    sources: int
    """Number of source ranks (plan ranks 0..sources-1)."""
    targets: int
    """Number of target ranks (plan ranks sources..sources+targets-1)."""
    host: tuple[int, ...]
    """Host of each plan rank."""
    gpu: tuple[int, ...]
    """GPU (within its host) of each plan rank."""
    nic: tuple[int, ...]
    """Global NIC id of each plan rank (host * nics_per_host + local NIC)."""
    nics_per_host: int
    """NICs in each host."""
    nic_gbps: float
    """Bandwidth of one NIC, one direction, Gb/s."""
    nvlink_gbps: float
    """Bandwidth of one GPU's NVLink, one direction, Gb/s."""
    hosts: int
    """Hosts used."""

    @property
    def world(self) -> int:
        return self.sources + self.targets

    def nic_name(self, nic: int) -> str:
        return f"h{nic // self.nics_per_host}/nic{nic % self.nics_per_host}"


def _nic_of_gpu(c: ClusterConfig, gpu: int) -> int:
    if c.nic_gpus is not None:
        return next(n for n, gpus in enumerate(c.nic_gpus) if gpu in gpus)
    return gpu // (c.gpus_per_host // c.nics_per_host)


def build_topology(c: ClusterConfig, sources: int, targets: int) -> Topology:
    """Place `sources` then `targets` ranks on the cluster; `cluster.hosts`, when given, must
    be what they need (the one home of that rule)."""
    g = c.gpus_per_host
    if c.placement == "colocated":
        sg = c.source_gpus_per_host or g // 2
        tg = g - sg
        spots = [(i // sg, i % sg) for i in range(sources)]
        spots += [(j // tg, sg + j % tg) for j in range(targets)]
        hosts = max(-(-sources // sg), -(-targets // tg))
    else:
        src_hosts = -(-sources // g)
        spots = [(i // g, i % g) for i in range(sources)]
        spots += [(src_hosts + j // g, j % g) for j in range(targets)]
        hosts = src_hosts + -(-targets // g)
    if c.hosts is not None and c.hosts != hosts:
        raise ConfigError(f"cluster.hosts: {c.hosts} does not match the world sizes: {sources} "
                          f"source + {targets} target ranks ({c.placement}, {g} GPUs per "
                          f"host) need {hosts} hosts; set cluster.hosts: {hosts} or remove it")
    host = tuple(h for h, _ in spots)
    gpu = tuple(x for _, x in spots)
    nic = tuple(h * c.nics_per_host + _nic_of_gpu(c, x) for h, x in spots)
    return Topology(sources, targets, host, gpu, nic, c.nics_per_host, c.nic_gbps,
                    c.nvlink_gbps, hosts)
