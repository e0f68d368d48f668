"""The offline compiler: a config (YAML) and a model spec in, a plan file out (`compiler`),
through pure passes (`passes/`) over both sides' layouts (`layouts/`); the plan tools beside
it (`tools/`: verify, simulate, inspect, plot, explain, tensors); `replan` for a new expert
placement. A regular package, so one checkout's `planner` never mixes with another's."""
