#!/bin/bash
# Issue 18 on one H200 (device tool): the serving replica's pinned-staging load.
#  1. tests/rl/test_weight_staging.py on CUDA (the pinned path; <= 60 s)
#  2. bench-weights, Qwen3-30B-A3B shape, 12 of 48 layers (16.2 GB), on the root disk (/var/tmp, not a tmpfs):
#     <= 170 s (the replica table and JSON are written before the optional step comparison, so a timeout there
#     still leaves them). Total <= ~4 min. Run from the repository root with the machine's python3; results in $OUT.
set -u
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
export PYTHONPATH=/tmp/shim
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  nproc; free -g; ulimit -l; python3 -c 'import torch, xxhash; print(torch.__version__, xxhash.VERSION)' 2>&1; } > "$OUT/machine.txt"
D=/var/tmp/moerl-bench-weights
rm -rf "$D"; mkdir -p "$D"
{ findmnt -n -o SOURCE,FSTYPE --target "$D"; df -h "$D"; } >> "$OUT/machine.txt" 2>&1
timeout 60 python3 -m pytest tests/rl/test_weight_staging.py -q -p no:cacheprovider > "$OUT/test-weight-staging.log" 2>&1
echo "rc=$?" >> "$OUT/test-weight-staging.log"
timeout 170 python3 -m moe_rl_eks.tools.bench.weights --dir "$D" --layers 12 --steps 2 \
  --out "$OUT/bench-weights.json" > "$OUT/bench-weights.log" 2>&1
echo "rc=$?" >> "$OUT/bench-weights.log"
rm -rf "$D"
cat "$OUT/bench-weights.log"
