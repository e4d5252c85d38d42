#!/bin/bash
# Issue 30 on one host of 2 H200s: device kind nvidia-h200-x2, carry [".whl", ".fetched/DeepEP"] (.whl/: the
# git-ignored cp312 wheels of fastapi, uvicorn, pydantic...; .fetched/DeepEP: DeepEP V1 at images/versions.env's
# DEEPEP_COMMIT, fetched and `git archive`d there). From the repository root, one device call each (BUDGET, default
# 560 s, bounds a call under the device tool's 10 minutes; STEPS picks what it runs):
#   STEPS=rl-sync bash tools/gpu_runs/h200x2.sh        # bench-rl --gpu --placement split --mode sync, parts alone first
#   STEPS=rl-async bash tools/gpu_runs/h200x2.sh       # split, async at staleness 1 then 2 (or rl-async-1, rl-async-2)
#   STEPS="deepep tests" bash tools/gpu_runs/h200x2.sh
#   STEPS="deepep sharded train rollout" bash tools/gpu_runs/h200x2.sh
# rl-*: the trainer on GPU 0, the rollout server on GPU 1, the orchestrator on the CPU, bench-rl --gpu's shape
#   (RL_STEPS steps, default 3); async compares with COMPARE (default the rl-sync call's results.json, there while
#   the machine is held, or carried) for the split target async samples/s >= 0.85 x min(rollout alone, trainer
#   alone); every mode reports each version's publication-to-served seconds beside the trainer's step.
# deepep: DeepEP V1 built from the carried source (~80-150 s) into /tmp/deepep; the tests that need it skip without.
# tests: one rank per GPU over NCCL, each against one rank: DeepEP normal kernels and alltoall against local (outputs,
#   loss, gradients); DeepEP low-latency decode against the single-GPU engine; the trainer's EP2 and FSDP2 x EP2 RL
#   step (loss, gradients, AdamW state).
# sharded: the sharded HTTP rollout server, a rank per GPU, against one process (tests/rl/test_sharded_rollout.py).
# train: bench-train --ranks 2 (EP2 over NCCL). rollout: bench-rollout one GPU against 2 GPUs at batch 64 and 256.
# Results in $OUT: steps.txt (each step's rc and seconds), machine.txt, one log per step, rl-*/results.*,
# pytest-*.xml, bench-train.json, bench-rollout.json.
set -u
BUDGET=${BUDGET:-560}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
read -r -a steps <<< "${STEPS:?STEPS: one or more of rl-sync rl-async rl-async-1 rl-async-2 deepep tests sharded train rollout}"
allowed=" rl-sync rl-async rl-async-1 rl-async-2 deepep tests sharded train rollout "
for s in "${steps[@]}"; do
    [[ $allowed == *" $s "* ]] || { echo "STEPS: '$s' is not one of:$allowed" >&2; exit 2; }
done
package_env
export PYTHONPATH=/tmp/deepep:$PYTHONPATH
export NVSHMEM_REMOTE_TRANSPORT=none  # one node: NVSHMEM reaches the other GPU peer to peer, no NIC
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'; } | tee "$OUT/machine.txt"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 2 ] || { echo "this machine has $gpus GPU(s); h200x2.sh needs 2 (device kind nvidia-h200-x2)" >&2; exit 2; }
python3 -c 'import moe_rl_eks.workloads.rollout.serve, moe_rl_eks.workloads.orchestrator.app, moe_rl_eks.workloads.trainer.loop' || exit 1

RESULTS=runs/bench-rl-gpu-split
limit() { local want=$1 have; have=$(left); echo $((want < have ? want : have)); }  # a step's share of what is left
rl() {  # rl NAME SECONDS FLAGS...: one bench-rl mode, split placement, its own --timeout inside the step's limit
    local name=$1 seconds=$2
    shift 2
    step "$name" "$seconds" python3 -m moe_rl_eks.tools.cli bench-rl --gpu --placement split --steps "${RL_STEPS:-3}" \
        --out "$RESULTS" --timeout $((seconds - 15)) "$@" > "$OUT/$name.log" 2>&1
    tail -n 16 "$OUT/$name.log"
    local mode=${name#rl-}
    mkdir -p "$OUT/$name" && cp "$RESULTS/${mode/-/}"/results.* "$OUT/$name/" 2>/dev/null
}
async() {  # async STALENESS SECONDS
    local compare=${COMPARE:-$RESULTS/sync/results.json} flags=()
    [ -f "$compare" ] && flags=(--compare "$compare")
    rl "rl-async-$1" "$2" --mode async --staleness "$1" "${flags[@]}"
}
tests() {  # tests NAME SECONDS PYTEST-ARGS...
    local name=$1 seconds=$2
    shift 2
    step "$name" "$seconds" python3 -m pytest -q -s -p no:cacheprovider -rs --junitxml "$OUT/pytest-$name.xml" "$@" \
        > "$OUT/$name.log" 2>&1
    grep -h "DEEPEP_LL_RESULT\|passed\|failed\|skipped\|Error" "$OUT/$name.log" | tail -n 8
}
FSDP=tests/rl/test_trainer_fsdp.py::test_fsdp_over_ep_ranks_steps_as_one_process_loss_gradients_and_weights
for s in "${steps[@]}"; do
    case $s in
        rl-sync) rl rl-sync "$(limit 560)" --mode sync ;;
        rl-async) async 1 $(($(left) / 2)); async 2 "$(left)" ;;
        rl-async-1|rl-async-2) async "${s#rl-async-}" "$(left)" ;;
        deepep)
            if [ -d .fetched/DeepEP ]; then step deepep "$(limit 180)" bash -c build_deepep > "$OUT/deepep.log" 2>&1
            else echo "deepep: .fetched/DeepEP not carried; the DeepEP tests skip" | tee -a "$OUT/steps.txt"; fi
            tail -n 3 "$OUT/deepep.log" 2>/dev/null ;;
        tests)
            tests tests-ep "$(limit 150)" -k one_rank_per_gpu tests/workloads/test_deepep_gpu.py  # 4 and 8 skip
            tests tests-ll "$(limit 150)" -k per_gpu tests/workloads/test_deepep_ll_gpu.py
            tests tests-trainer "$(limit 150)" "${FSDP}[2-grpo-True]" "${FSDP}[2-ppo-True]" ;;
        sharded) select="not nothing"; python3 -c 'import httpx' 2>/dev/null || select="not streams"
                 tests sharded "$(limit 150)" -k "$select" tests/rl/test_sharded_rollout.py ;;
        train) step train "$(limit 150)" python3 -m moe_rl_eks.tools.cli bench-train --ranks 2 --compute triton \
                   --checkpointing save_attention --shapes 8x8192 --steps 2 --layers "${TRAIN_LAYERS:-10}" \
                   --publish "$(mktemp -d)" --json "$OUT/bench-train.json" > "$OUT/train.log" 2>&1
               tail -n 12 "$OUT/train.log" ;;
        rollout) step rollout "$(limit 150)" python3 -m moe_rl_eks.tools.cli bench-rollout --gpus-per-server 1 2 \
                     --compute triton --layers "${ROLLOUT_LAYERS:-8}" --batches 64 256 --prompt-tokens 128 \
                     --new-tokens 128 --json "$OUT/bench-rollout.json" > "$OUT/rollout.log" 2>&1
                 tail -n 12 "$OUT/rollout.log" ;;
    esac
done
echo "total $((SECONDS - START)) s"
exit 0
