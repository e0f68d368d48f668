#!/usr/bin/env bash
# Install vLLM 0.33.0 for the CPU oracle without touching torch (must stay 2.13.0+cpu).
# Usage: tests/oracles/install_vllm.sh [path/to/vllm-0.33.0-*.whl]
#   (default: download the wheel with `pip download --no-deps vllm==0.33.0`, ~336 MB).
# Everything goes in with --no-deps: vLLM's declared deps pull a CUDA torch, triton and
# CUDA kernels, none of which the CPU oracle path imports.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
wheel="${1:-}"
if [ -z "$wheel" ]; then
  dir="$(mktemp -d)"
  "$python" -m pip download --no-deps vllm==0.33.0 -d "$dir"
  wheel="$(ls "$dir"/vllm-0.33.0-*.whl)"
fi
torch_before="$("$python" -c 'import torch; print(torch.__version__)')"
"$python" -m pip install --no-deps "$wheel" -r "$here/requirements-vllm.txt"
torch_after="$("$python" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
  echo "install_vllm.sh: torch changed from $torch_before to $torch_after" >&2
  exit 1
fi
VLLM_TARGET_DEVICE=cpu "$python" -c "import vllm.model_executor.model_loader, vllm.distributed"
echo "vLLM 0.33.0 installed (torch $torch_after)"
