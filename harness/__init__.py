"""What runs a world of ranks on one machine and the synthetic weights they carry, for
`scripts/demo.py`, the benchmarks and the tests: `harness.launch` (processes, ports, a store),
`harness.weights` (torch tensors from logical ones, and their FP8 form). Neither the compiler
nor the executor imports this package."""
