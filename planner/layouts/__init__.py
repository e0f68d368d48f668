"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors.

One module per framework and engine (`megatron`, `fsdp2`, `vllm`, `sglang`; `traced` for
vLLM layouts traced from the engine's loader), each the only home of its rules; the
vocabulary they share is `base`. `planner.frameworks` dispatches to them (`build_layout`,
`start_layout`); nothing here imports the rest of the planner but the model spec
(`planner.spec`, `planner.models`) and the error types (`planner.errors`).
"""
