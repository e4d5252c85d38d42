#!/bin/bash
# `moerl bench-rl --gpu` on one H200 (device tool; issue 25 item 4): sync (with the parts measured alone), then
# async at staleness 1, then staleness 2, each mode one command of STEPS steps (default 3) within its share of
# BUDGET (default 330 s: a mode that runs out reports the steps it finished). Estimated on the H200: start-up ~90 s
# a mode (triton compiles, the trainer's random init, version 0 to disk), a sync step ~60-90 s, the standalone parts
# ~150 s; so one call of 570 s holds `MODES=sync`, and a second `MODES="async-1 async-2"`. No pip
# step (the machine reaches no registry): the package from a shim on PYTHONPATH, fastapi/uvicorn/pydantic from .whl/
# (git-ignored cp312 wheels, carried). From the repository root: BUDGET=330 bash tools/gpu_runs/h200-bench-rl-gpu.sh
# [extra bench-rl --gpu flags]; results (results.json/.md per mode), logs and the machine in $OUT. Each process's
# first triton compile costs 45-75 s; nothing is warmed up (random weights, no warm-up SFT).
set -u
BUDGET=${BUDGET:-330}
STEPS=${STEPS:-3}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
package_env
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$OUT/machine.txt"
# every role's imports, before any role starts (a missing wheel fails here, not after a start-up timeout)
python3 -c 'import moe_rl_eks.workloads.rollout.serve, moe_rl_eks.workloads.orchestrator.app, moe_rl_eks.workloads.trainer.loop' || exit 1
bench() {  # bench NAME SECONDS FLAGS...: one mode, its own --timeout 15 s inside the step's limit (results written)
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 -m moe_rl_eks.tools.cli bench-rl --gpu --steps "$STEPS" --out runs/bench-rl-gpu \
        --timeout $((limit - 15)) "$@" > "$OUT/$name.log" 2>&1
    tail -n 14 "$OUT/$name.log"
    mkdir -p "$OUT/$name" && cp runs/bench-rl-gpu/"${name/-/}"/results.* "$OUT/$name/" 2>/dev/null
    for log in runs/bench-rl-gpu/"${name/-/}"/run/logs/*.log; do
        [ -f "$log" ] && tail -n 40 "$log" > "$OUT/$name/$(basename "$log" .log)-tail.log"
    done
}
# MODES (default all three, in order) share what is left of the budget evenly; an async mode compares with the sync
# results of this call or of an earlier one on the same machine (runs/ stays while the machine is held)
read -r -a modes <<< "${MODES:-sync async-1 async-2}"
for i in "${!modes[@]}"; do
    mode=${modes[$i]}
    limit=$(( $(left) / (${#modes[@]} - i) ))
    case $mode in
        sync) bench sync "$limit" --mode sync "$@" ;;
        async-*) compare=(); [ -f runs/bench-rl-gpu/sync/results.json ] && compare=(--compare runs/bench-rl-gpu/sync/results.json)
                 bench "$mode" "$limit" --mode async --staleness "${mode#async-}" "${compare[@]}" "$@" ;;
        *) echo "MODES: $mode is not one of sync, async-1, async-2" | tee -a "$OUT/steps.txt" ;;
    esac
done
exit 0
