#!/bin/bash
# `make run-gpu` on one H200 (device tool), without the pip step (the machine reaches no registry): the package from
# a shim on PYTHONPATH, fastapi/uvicorn/pydantic from .whl/ (git-ignored cp312 wheels, carried). From the repository
# root: bash tools/gpu_runs/h200-run-gpu.sh [local-run flags] [extra pytest files to run first]; logs and results in
# $OUT. The flags are local-run's (--quick; --numerics, --importance-correction, --max-staleness: the numerics A/B,
# one arm per call, docs/benchmarks.md), each --flag with its value except --quick. A previous call's kernel cache
# is used when carried (budget.sh: restore_kernel_cache), and this call's comes back in triton-cache.tgz.
set -u
BUDGET=${BUDGET:-570}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
# autotuning's choices on disk too: the roles' processes, and a later call carrying the cache, reuse them
export TRITON_CACHE_AUTOTUNING=1
package_env
mode=()
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
    if [ "$1" = --quick ]; then mode+=("$1"); shift; else mode+=("$1" "${2:?$1 needs a value}"); shift 2; fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"
# every role's imports, before any role starts (a missing wheel fails here, not after a start-up timeout)
python3 -c 'import moe_rl_eks.workloads.rollout.serve, moe_rl_eks.workloads.orchestrator.app, moe_rl_eks.workloads.trainer.loop' || exit 1
if [ $# -gt 0 ]; then
    step tests 180 python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/tests.log" 2>&1
    tail -n 5 "$OUT/tests.log"
fi
( while sleep 0.1; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits; done ) \
    > "$OUT/nvml.csv" 2>/dev/null &
sampler=$!
step run-gpu $(( $(left) - 20 )) python3 -m moe_rl_eks.tools.cli local-run --run configs/runs/gpu.yaml "${mode[@]}" \
    --timeout $(( $(left) - 60 )) 2>&1 | tee "$OUT/run-gpu.log" | tail -n 12
kill $sampler
# the run's name, as local-run derived it from the flags (its first line: "local-run NAME: ..."): its output folder
name=$(grep -m1 -o '^local-run [^:]*' "$OUT/run-gpu.log" | cut -d' ' -f2)
run=runs/${name:-gpu}
cp "$run/summary.json" "$OUT/summary.json" 2>/dev/null
cp "$run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null  # every RL step: reward, mismatch, importance weights
cp "$run/reward_curve.png" "$OUT/reward_curve.png" 2>/dev/null
tail -n 60 "$run/logs/trainer.log" > "$OUT/trainer-tail.log" 2>/dev/null
tail -n 40 "$run/logs/rollout-0.log" > "$OUT/rollout-tail.log" 2>/dev/null
# how each version reached the colocated server: device memory (rl/device_weights.py) or the store
grep -o "installed from the [a-z]*" "$run/logs/rollout-0.log" 2>/dev/null | sort | uniq -c | tee "$OUT/weight-paths.txt"
tail -n 40 "$run/logs/orchestrator.log" > "$OUT/orchestrator-tail.log" 2>/dev/null
# the device tool returns at most 8 files: the small logs travel as one archive
tar -C "$OUT" -czf "$OUT/logs.tgz" machine.txt nvml.csv trainer-tail.log rollout-tail.log orchestrator-tail.log \
    weight-paths.txt 2>/dev/null && rm -f "$OUT"/{machine.txt,nvml.csv,trainer-tail.log,rollout-tail.log} \
    "$OUT"/{orchestrator-tail.log,weight-paths.txt}
save_kernel_cache
exit 0
