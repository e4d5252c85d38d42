#!/bin/bash
# Issue 27's H200 check of the trainer at scale, one call (device tool): bench-train of one EP8 rank's share of
# Qwen3-235B-A22B (16 of 128 experts, each token to top-8 of them; 12 of its 94 layers fit one H200 with AdamW)
# and, as the planner's calibration point, 8 layers of Qwen3-30B-A3B; each row with the planner's predicted memory.
# The 235B share also over 2 micro-batches a step (the planner's peak). From the repository root with the machine's
# python3 (no wheels needed); results in $OUT.
set -u
BUDGET=${BUDGET:-330}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
step train-235b-share $(( $(left) * 2 / 3 )) python3 -m moe_rl_eks.tools.bench.train --model qwen3-235b-a22b \
    --ep-share 8 --layers 12 --shapes 1x8192 --compute triton --checkpointing save_attention,full --steps 2 \
    --json "$OUT/train-235b-ep8-share.json" > "$OUT/train-235b-ep8-share.log" 2>&1
grep '^|' "$OUT/train-235b-ep8-share.log"
# The same share over 2 micro-batches a step: the second holds every gradient beside its activations, the case the
# planner's peak counts (a step of one micro-batch frees activations as gradients arrive, so it peaks lower).
step train-235b-share-2mb $(( $(left) / 2 )) python3 -m moe_rl_eks.tools.bench.train --model qwen3-235b-a22b \
    --ep-share 8 --layers 12 --shapes 1x8192 --microbatches 2 --compute triton --checkpointing save_attention \
    --steps 2 --json "$OUT/train-235b-ep8-share-2mb.json" > "$OUT/train-235b-ep8-share-2mb.log" 2>&1
grep '^|' "$OUT/train-235b-ep8-share-2mb.log"
step train-30b $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.train --layers 8 --shapes 8x8192 \
    --compute triton --checkpointing full --steps 2 --json "$OUT/train-30b.json" > "$OUT/train-30b.log" 2>&1
grep '^|' "$OUT/train-30b.log"
