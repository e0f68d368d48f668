"""GPU benchmark: refit time of rdma-plan vs NCCL broadcast vs the NVLink floor.

    PYTHONUNBUFFERED=1 python3 -m bench.gpu_refit [--models qwen3-8b,qwen3-30b-a3b]
        [--transports cuda_ipc[,nixl]] [--steps 20] [--warmup 3] [--out DIR]
    python3 -m bench.gpu_refit --cpu-dry-run      # the whole logic on CPU (gloo, nixl)
    python3 -m bench.gpu_refit --tiny             # the same in seconds (the test suite's)
    python3 -m bench.gpu_refit --render results.json --write-md BENCHMARKS.md

One run on one host with 4 GPUs: 4 processes, one per GPU. Ranks 0-1 are the trainers
(Megatron layout, random bf16 weights generated on the GPU piece by piece from a
deterministic hash of (logical tensor, element index)), ranks 2-3 the inference engine
(vLLM layout, zeros). Per model:

  (a) rdma-plan: the compiled plan replayed by `executor.run` over `cuda_ipc` (and
      optionally `nixl`, UCX over CUDA IPC): per-step wall time over all 4 ranks;
  (b) the baseline most RL frameworks use: logical tensors in 1 GiB buckets; per bucket
      the trainers all-gather their non-replicated shards (NCCL), trainer 0 assembles the
      full HF tensors, broadcasts the bucket (NCCL, group {trainer 0} + inference ranks)
      and each inference rank copies its shards out of it (fusing q/k/v, gate/up, experts
      as vLLM's weight loaders do: one copy per piece of its layout);
  (c) the floor: the most bytes any inference GPU receives / the GPU0 -> GPU2 peer-copy
      bandwidth measured in the same run (`dst.copy_(src)` of a 4 GiB buffer).

`MODEL:fp8` (e.g. `qwen3-8b:fp8`) has block-FP8 inference weights (`target.dtype:
fp8_block128`): the trainers quantize in the transfer, every FP8 piece is checked against
the reference quantizer (on the CPU for the first `--fp8-cpu-check` elements of a rank, on
the GPU after), the NCCL baseline is skipped, and the report gives its time over the bf16
model's. `nixl-nosgl` posts a put per write (NIXL's scatter-gather off), for comparison.

A step's time is max(end over ranks) - min(start over ranks) after a barrier (CLOCK_MONOTONIC
is shared by the processes of one host). After (a) and after (b) every inference tensor is
compared bit-exactly with the reference, generated independently from the target layout's
pieces (padding zero); the sources get new values (another seed) before each method so a
stale result cannot pass. `--cpu-dry-run`: tiny models, gloo instead of NCCL, `nixl`
(UCX, DRAM) instead of `cuda_ipc`; it also checks the generator against
`harness.weights`.

Modules: `setup` (who runs where: the `Setup` dataclass), `weights` (the deterministic
generator and the bit-exact check), `ctx` (the worker's process groups, barriers and
timed steps), `floor` (peer-copy floor and copy micro-benchmark), `baseline` (the NCCL
baseline), `run` (one model, every method, in a worker), `report` (tables, BENCHMARKS.md)
and `cli` (the parent: compile, launch the workers, render).
"""
