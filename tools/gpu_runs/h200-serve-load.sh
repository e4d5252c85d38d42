#!/bin/bash
# Issue 25 (item 5) on one H200 (device tool): a served checkpoint's cold load against dd iflag=direct of the same
# files, same command (bench-load): 8 layers of the Qwen3-30B-A3B shape with random weights (11.2 GB) written to
# the root disk (/var/tmp, not a tmpfs), then dd, the replica's O_DIRECT read into pinned staging (twice: the first
# makes and pins the buffers), and the server's whole first load onto the GPU. Expected ~70 s (budget 120 s).
# From the repository root with the machine's python3; carry .whl/ where it exists.
# Results in $OUT: steps.txt, bench-load.{json,log}.
set -u
BUDGET=${BUDGET:-120}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
if [ -d .whl ]; then python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
D=/var/tmp/moerl-bench-load
step bench-load $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.load --dir "$D" --layers 8 \
    --json "$OUT/bench-load.json" > "$OUT/bench-load.log" 2>&1
rm -rf "$D"
cat "$OUT/bench-load.log"
