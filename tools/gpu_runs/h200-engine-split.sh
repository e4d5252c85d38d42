#!/bin/bash
# The rollout engine split (issue 24) on one H200 (device tool): bench-rollout at batch 1 / 64 / 256 on the commit
# before the split and on this tree, same machine, one call (before, after, then a second pair while time is left,
# so drift shows), then the paged-attention kernel tests compiled (they include the engine's forward on these
# kernels and a weight install into a decoder on them). The engine's other CUDA tests: h200-engine-tests.sh.
# From the repository root with the machine's python3; carry .whl/ and .fetched/before-split, made here with
#   mkdir -p .fetched/before-split && git archive 8018258 core kernels workloads tools | tar -x -C .fetched/before-split
# Results in $OUT: steps.txt, rollout-{before,after}-{1,2}.{json,log}, kernels.log.
set -u
BUDGET=${BUDGET:-570}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
for tree in before after; do
    root=$PWD && [ $tree = before ] && root=$PWD/.fetched/before-split
    mkdir -p /tmp/shim-$tree/moe_rl_eks
    for p in core infra k8s workloads kernels tools; do ln -sfn "$root/$p" /tmp/shim-$tree/moe_rl_eks/$p; done
done
export PYTHONUNBUFFERED=1

bench() {  # bench TREE RUN: h200-verify.sh's bench-rollout command, without the transformers baseline
    local limit=$(( $(left) < 150 ? $(left) : 150 ))
    PYTHONPATH=/tmp/site:/tmp/shim-$1 step "rollout-$1-$2" $limit python3 -m moe_rl_eks.tools.bench.rollout \
        --batches 1 64 256 --prompt-tokens 128 --compute triton --mismatch-layers 0 --max-seconds 4 \
        --json "$OUT/rollout-$1-$2.json" > "$OUT/rollout-$1-$2.log" 2>&1
    grep -i "decode" "$OUT/rollout-$1-$2.log" | tail -n 4
}
bench before 1
bench after 1
if [ "$(left)" -gt 340 ]; then
    bench before 2
    bench after 2
fi
# Compiled kernels: --noconftest keeps tests/kernels/conftest.py from turning the interpreter on.
PYTHONPATH=/tmp/site:/tmp/shim-after step kernels "$(left)" python3 -m pytest -q -p no:cacheprovider --noconftest \
    tests/kernels/test_decode_attention.py > "$OUT/kernels.log" 2>&1
tail -n 2 "$OUT/kernels.log"
