#!/bin/bash
# Issue 25 (item 2) on one H200 (device tool): a weight version to a rollout server on the trainer's GPU through
# device memory (CUDA IPC, workloads/rl/device_weights.py) beside the store path, same run: bench-weights at 8 of
# the 48 layers of the Qwen3-30B-A3B shape (11.2 GB in bf16) on the root disk (/var/tmp, not a tmpfs), no step
# comparison; then, while time is left, tests/rl/test_device_weights.py's CUDA cases (a server process takes each
# version by IPC handle, bit-equal and in order; skipped under 15 s left). Expected: the bench ~70 s, the tests ~20 s
# more where the budget leaves them (90 s in all). From the repository root with the
# machine's python3; carry .whl/ (git-ignored cp312 wheels the machine lacks) where it exists.
# Results in $OUT: steps.txt, machine.txt, bench-weights-ipc.{json,log}, device-weights-tests.log.
set -u
BUDGET=${BUDGET:-90}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
if [ -d .whl ]; then python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
D=/var/tmp/moerl-bench-weights-ipc
rm -rf "$D"; mkdir -p "$D"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1; free -g; ulimit -l
  findmnt -n -o SOURCE,FSTYPE --target "$D"; } > "$OUT/machine.txt" 2>&1
step bench-weights-ipc $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.weights --dir "$D" --layers 8 \
    --steps 0 --baseline-gb 4 --budget-s 60 --out "$OUT/bench-weights-ipc.json" > "$OUT/bench-weights-ipc.log" 2>&1
rm -rf "$D"
tail -n 24 "$OUT/bench-weights-ipc.log"
step device-weights-tests $(( $(left) - 3 )) python3 -m pytest -q -p no:cacheprovider -k cuda \
    tests/rl/test_device_weights.py > "$OUT/device-weights-tests.log" 2>&1
tail -n 3 "$OUT/device-weights-tests.log"
