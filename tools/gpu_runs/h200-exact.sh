#!/bin/bash
# The exact numerics mode's kernels (issue 28, first part) on one H200 (device tool): their tests compiled
# (--noconftest keeps tests/kernels/conftest.py from turning the interpreter on): a row's bits alone, among 3 or 17
# rows, at any position, for the invariant matmul, RMSNorm, the log-softmax statistics, the expert GEMMs, and
# decode attention over the paged cache against the packed causal forward, and (float32 and bf16) a tiny model's
# logits, routing and log-softmax statistics from the engine's prefill and decode against the trainer's exact
# forward; then kernels/bench_exact.py: each exact
# kernel against the fast one at Qwen3-30B-A3B's shape (qkv, o_proj and lm_head at 1 / 64 / 256 / 4096 rows, decode
# attention at batch 1 / 64 over 2048 positions, the experts' forward at 64 / 2048 tokens), a table.
# From the repository root with the machine's python3; carry .whl/ (as h200-engine-split.sh does).
# Expected: ~90 s (limit 90; the benchmark prints each row as it is measured, so a cut keeps the rows before it). Results in $OUT: steps.txt, tests.log, bench.log, bench-exact.json.
set -u
BUDGET=${BUDGET:-90}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1

step tests 45 python3 -m pytest -q -p no:cacheprovider --noconftest tests/kernels/test_invariant_matmul.py \
    tests/kernels/test_invariant_rows.py tests/kernels/test_invariant_experts.py \
    tests/kernels/test_invariant_attention.py tests/kernels/test_exact_forward.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|Error" "$OUT/tests.log" | tail -n 4
step bench "$(left)" python3 -m moe_rl_eks.kernels.bench_exact --json "$OUT/bench-exact.json" > "$OUT/bench.log" 2>&1
cat "$OUT/bench.log"
