#!/bin/bash
# server (issue 13): bench-server on one H200 at issue 10's benchmark shape (Qwen3-30B-A3B, all 48 layers, 128-token
# prompts, 256 new tokens, groups of n = 8, concurrency 64 and 256; engine direct vs HTTP vs SSE in one run), then,
# if time is left, the 4-layer stress row. Runs from the repository root; needs .whl/ (git-ignored: cp312 wheels of fastapi, starlette, uvicorn, pydantic and their dependencies, which the GPU machine lacks) carried.
# Expected: ~200 s (hard limit 235 s in all). Results: $OUT/bench-server-48.{json,log}, $OUT/bench-server-4.{json,log}.
set -u
BUDGET=235
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
timeout 40 python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 \
  || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# The whole model: the issue's target row.
timeout --kill-after=5 $(( $(left) - 45 )) python3 -m moe_rl_eks.tools.bench.server --model qwen3 \
  --json "$OUT/bench-server-48.json" > "$OUT/bench-server-48.log" 2>&1
echo "48 layers: rc $? after $((SECONDS - START)) s"; tail -12 "$OUT/bench-server-48.log"
# 4 layers (a cheap step: the server's per-token work shows most), as in the previous session's figure.
if [ "$(left)" -gt 30 ]; then
  timeout --kill-after=5 $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.server --model qwen3 --layers 4 \
    --requests 128 --max-tokens 128 --json "$OUT/bench-server-4.json" > "$OUT/bench-server-4.log" 2>&1
  echo "4 layers: rc $? after $((SECONDS - START)) s"; tail -12 "$OUT/bench-server-4.log"
fi
