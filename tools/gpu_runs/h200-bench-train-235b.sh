#!/bin/bash
# Issue 27's H200 check of the trainer at scale, one call (device tool): bench-train of one EP8 rank's share of
# Qwen3-235B-A22B (16 of 128 experts, each token to top-8 of them; 12 of its 94 layers fit one H200 with AdamW)
# and, as the planner's calibration point, 8 layers of Qwen3-30B-A3B; each row with the planner's predicted memory.
# The 235B share also over 2 micro-batches a step (the planner's peak), and over each count in MICROBATCHES
# (default "2"; the planner's 1,048,576 tokens a step over 64 GPUs is 2 of 8,192 tokens per GPU, 2,097,152 is 4).
# STEPS (default "share accumulate 30b") picks the runs; "attention" adds bench-train-attention (flash vs cuDNN per
# sequence length) and the packed attention's backend test on CUDA. From the repository root with the machine's
# python3 (no wheels needed); results in $OUT. PROFILE=1: after the first count's row, bench-train's torch.profiler
# table of one more step (of one micro-batch: where a micro-batch's time goes, and the optimizer's) in profile.txt.
set -u
STEPS=${STEPS:-share accumulate 30b}
has() { [[ " $STEPS " == *" $1 "* ]]; }
BUDGET=${BUDGET:-330}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
package_env
if has attention; then
    step attention-tests 60 python3 -m pytest -q -p no:cacheprovider tests/workloads/test_packed_attention_backends.py \
        > "$OUT/attention-tests.log" 2>&1
    tail -n 3 "$OUT/attention-tests.log"
    step bench-train-attention 90 python3 -m moe_rl_eks.tools.bench.train_attention \
        --json "$OUT/bench-train-attention.json" > "$OUT/bench-train-attention.log" 2>&1
    cat "$OUT/bench-train-attention.log"
fi
if has share; then
    step train-235b-share $(( $(left) * 2 / 3 )) python3 -m moe_rl_eks.tools.bench.train --model qwen3-235b-a22b \
        --ep-share 8 --layers 12 --shapes 1x8192 --compute triton --checkpointing save_attention,full --steps 2 \
        --json "$OUT/train-235b-ep8-share.json" > "$OUT/train-235b-ep8-share.log" 2>&1
    grep '^|' "$OUT/train-235b-ep8-share.log"
fi
# The same share over N micro-batches a step: from the second on every gradient is held beside its activations, the
# case the planner's peak counts (a step of one micro-batch frees activations as gradients arrive, so it peaks lower);
# the optimizer step's fixed cost is shared by N micro-batches, as in a trainer's step.
if has accumulate; then
    profile=() && [ -n "${PROFILE:-}" ] && profile=(--profile "$OUT/profile.txt")
    for mb in ${MICROBATCHES:-2}; do
        step train-235b-share-${mb}mb $(( $(left) / 2 )) python3 -m moe_rl_eks.tools.bench.train \
            --model qwen3-235b-a22b --ep-share 8 --layers 12 --shapes 1x8192 --microbatches "$mb" --compute triton \
            --checkpointing save_attention --steps 2 "${profile[@]}" --json "$OUT/train-235b-ep8-share-${mb}mb.json" \
            > "$OUT/train-235b-ep8-share-${mb}mb.log" 2>&1
        grep '^|' "$OUT/train-235b-ep8-share-${mb}mb.log"
        profile=()  # the profiled step is the same at every count
    done
fi
if has 30b; then
    step train-30b $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.train --layers 8 --shapes 8x8192 \
        --compute triton --checkpointing full --steps 2 --json "$OUT/train-30b.json" > "$OUT/train-30b.log" 2>&1
    grep '^|' "$OUT/train-30b.log"
fi
