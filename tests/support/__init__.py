"""Shared helpers of the test suite, the benchmarks and the demo (never tests themselves).

- `procs`: `free_port`, `spawn_ranks`: ranks as separate processes on this machine.
- `plans`: hand-built plans (`rank_plan`, `plan_of`, the 2 x 2 example) for the executor,
  the simulator and the verifier, their signals derived by the protocol's rule.
- `synthetic`: hand-built layouts (row splits, fused column splits) for compiler tests.
- `models`, `coverage`, `targets`: tiny HF configs and the layout coverage checks.
"""
