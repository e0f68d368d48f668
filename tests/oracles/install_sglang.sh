#!/usr/bin/env bash
# Install SGLang 0.5.23 for the CPU oracle into a private folder (see sglang_env.py):
#   SITE = $RDMA_PLAN_SGLANG_SITE, else $RDMA_PLAN_CACHE/sglang-0.5.23 (default cache
#   ~/.cache/rdma-plan)
# with --no-deps, so that torch (2.13.0+cpu), transformers and vLLM's packages are never
# replaced and triton never reaches the other tests. Idempotent: a complete SITE (marker
# file written last) returns at once.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
site="${RDMA_PLAN_SGLANG_SITE:-${RDMA_PLAN_CACHE:-$HOME/.cache/rdma-plan}/sglang-0.5.23}"
req="$here/requirements-sglang.txt"
marker="$site/.rdma-plan-installed"
if [ -f "$marker" ] && cmp -s "$marker" "$req"; then
  echo "SGLang 0.5.23 already installed in $site"
  exit 0
fi
torch_before="$("$python" -c 'import torch; print(torch.__version__)')"
rm -rf "$site"
mkdir -p "$site"
"$python" -m pip install -q --disable-pip-version-check --no-deps --target "$site" -r "$req"
torch_after="$("$python" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
  echo "install_sglang.sh: torch changed from $torch_before to $torch_after" >&2
  exit 1
fi
RDMA_PLAN_SGLANG_SITE="$site" PYTHONPATH="$here/../..:${PYTHONPATH:-}" "$python" -c \
  "from tests.oracles import sglang_env as e; e.prepare(); import sglang.srt.models.qwen3"
cp "$req" "$marker"
echo "SGLang 0.5.23 installed in $site (torch $torch_after)"
