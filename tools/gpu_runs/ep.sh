#!/usr/bin/env bash
# Issue 17's runs on one host of 4 or 8 H200s (device kinds nvidia-h200-x4 / nvidia-h200-x8), in one command:
#   bash tools/gpu_runs/ep.sh 4        # or 8; from the repository root, with the device's python3
# 1. this package installed (no network there: no dependencies fetched);
# 2. DeepEP V1 built by images/scripts/build_deepep.sh --variant stock-v1 (intranode) when its source at
#    images/versions.env's DEEPEP_COMMIT is carried at $DEEPEP_SRC (default .fetched/DeepEP, git-ignored: fetch
#    github:deepseek-ai/DeepEP, `git archive` that commit there, and name it in the call's carry); without it the
#    DeepEP tests and rows are skipped and say so;
# 3. tests/workloads/test_deepep_gpu.py -k one_rank_per_gpu: deepep == alltoall == local, one rank per GPU over
#    NCCL at 2, 4 (and 8) ranks; alltoall == local alone where DeepEP is not built;
# 4. moerl bench-ep at 2, 4 (and 8) ranks, one rank per GPU over NCCL;
# 5. moerl bench-train --ranks N: the trainer's step at EP N over NCCL, triton compute, Qwen3-30B-A3B's shape at
#    $TRAIN_LAYERS layers, and one publication through the Publisher (each rank its experts) to local disk;
# 6. moerl bench-rollout --gpus-per-server 1 N: the rollout engine sharded over N GPUs against one GPU.
# Each step has its own time limit (570 s in all: the device tool allows 10 minutes a command); STEPS picks a
# subset to split the work over two calls: STEPS="install deepep tests" then STEPS="install bench-ep train rollout".
# Everything lands in $OUT (at most 8 files come back): h200xN-ep.log, h200xN-steps.jsonl, h200xN-pytest.xml,
# h200xN-bench-ep.json, h200xN-bench-train.json, h200xN-bench-rollout.json.
set -uo pipefail
gpus=${1:-}
case $gpus in
    4|8) ;;
    *) echo "error: GPU count '$gpus'; allowed: 4 (nvidia-h200-x4), 8 (nvidia-h200-x8); usage: ep.sh 4|8" >&2; exit 2 ;;
esac
out=${OUT:?OUT (the folder whose files come back) must be set}
steps=${STEPS:-install deepep tests bench-ep train rollout}
deepep_src=${DEEPEP_SRC:-.fetched/DeepEP}
# Deep enough to fill the GPUs. An estimate, not a measurement: 5 layers a GPU put ~70 GiB of weights + AdamW
# state (float32, ~16 bytes a parameter) on each rank, leaving ~70 GiB for an 8 x 8,192-token micro-batch
# (bench-train measured 37 GiB above weights + optimizer at 8 layers on one H200). Under --ranks an OOM ends the
# step at its time limit; set TRAIN_LAYERS lower then.
train_layers=${TRAIN_LAYERS:-$((gpus * 5))}
# The one-GPU baseline holds every expert; a few layers keep its weights, written and read once per server size,
# within the step's time limit.
rollout_layers=${ROLLOUT_LAYERS:-8}
# Never NVLink multicast on these shared hosts (the device image sets these; keep them for spawned processes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
name="h200x$gpus"
log="$out/$name-ep.log"
mkdir -p "$out"
: >"$out/$name-steps.jsonl"

# step NAME LIMIT_SECONDS COMMAND...: run it under a time limit, log it, record its exit status and seconds.
step() {
    local step_name=$1 limit=$2 start rc
    shift 2
    [[ " $steps " == *" $step_name "* ]] || return 0
    echo "== $step_name (limit ${limit} s): $*"
    start=$SECONDS
    timeout "$limit" "$@"
    rc=$?
    echo "== $step_name exit $rc after $((SECONDS - start)) s"
    printf '{"step": "%s", "rc": %d, "seconds": %d, "limit": %d}\n' "$step_name" "$rc" "$((SECONDS - start))" \
        "$limit" >>"$out/$name-steps.jsonl"
}

# A function run under `timeout` (a child bash): exported with the variable it reads.
build_deepep() {
    if [[ ! -d "$deepep_src" ]]; then
        echo "DeepEP source not carried at $deepep_src: the deepep tests and rows are skipped"
        return 0
    fi
    local wheels
    wheels=$(mktemp -d)
    DEEPEP_COMMIT=$(sed -n 's/^DEEPEP_COMMIT=//p' images/versions.env) TORCH_CUDA_ARCH_LIST=9.0 \
        images/scripts/build_deepep.sh --variant stock-v1 --src "$deepep_src" --out "$wheels" 2>&1 | tail -n 20 &&
        python3 -m pip install -q --no-deps --no-index "$wheels"/deep_ep-*.whl &&
        python3 -c 'import deep_ep; print("deep_ep", deep_ep.__file__)'
}

export -f build_deepep
export deepep_src
{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
    step install 40 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
    step deepep 120 bash -c build_deepep
    # The one-rank-per-GPU cases; the ranks-sharing-cuda:0 ones ran on the single H200 already.
    step tests 140 python3 -m pytest -q -p no:cacheprovider --junitxml "$out/$name-pytest.xml" -rs \
        -k one_rank_per_gpu tests/workloads/test_deepep_gpu.py
    ranks=(2 4)
    ((gpus >= 8)) && ranks+=(8)
    step bench-ep 60 python3 -m moe_rl_eks.tools.cli bench-ep --ranks "${ranks[@]}" --out "$out/$name-bench-ep.json"
    step train 120 python3 -m moe_rl_eks.tools.cli bench-train --ranks "$gpus" --compute triton \
        --checkpointing save_attention --shapes 8x8192 --steps 2 --layers "$train_layers" \
        --publish "$(mktemp -d)" --json "$out/$name-bench-train.json"
    step rollout 90 python3 -m moe_rl_eks.tools.cli bench-rollout --gpus-per-server 1 "$gpus" --compute triton \
        --layers "$rollout_layers" --batches 64 256 --prompt-tokens 128 --new-tokens 128 \
        --json "$out/$name-bench-rollout.json"
} 2>&1 | tee "$log"
