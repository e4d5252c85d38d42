#!/bin/bash
# Re-verification on one H200 (device tool) of what changed after the last GPU runs: the paged attention kernels'
# shared helpers (decode_attention: online_softmax_step, paged_offsets, check_paged) compiled, the engine's CUDA
# tests through them, the rollout benchmark at batch 1, 64 and 256 (against the recorded 279 / 3,140 / 10,829
# decode tok/s), and DeepEP low-latency decode with both compute backends, so the test's tolerance can be set from
# a measurement. From the repository root with the machine's python3; carry .whl/ and .fetched/DeepEP.
# Results in $OUT: steps.txt, kernels.log, generation.log, rollout.json, rollout.log, deepep.log.
set -u
BUDGET=570
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/deepep:/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none

# DeepEP builds in the background (CPU) while the GPU runs the rest.
( MAX_JOBS=12 build_deepep && echo BUILD-OK ) > "$OUT/deepep.log" 2>&1 &
BUILD=$!

# Compiled kernels: --noconftest keeps tests/kernels/conftest.py from turning the interpreter on.
step kernels 150 python3 -m pytest -q -p no:cacheprovider --noconftest tests/kernels/test_decode_attention.py \
    > "$OUT/kernels.log" 2>&1
tail -n 2 "$OUT/kernels.log"
step generation 150 python3 -m pytest -q -p no:cacheprovider -k "cuda or triton" tests/rl/test_generation.py \
    > "$OUT/generation.log" 2>&1
tail -n 2 "$OUT/generation.log"
step rollout 170 python3 -m moe_rl_eks.tools.bench.rollout --batches 1 64 256 --prompt-tokens 128 \
    --compute triton --transformers-batches --mismatch-layers 0 --max-seconds 4 --json "$OUT/rollout.json" \
    > "$OUT/rollout.log" 2>&1
grep -i "decode" "$OUT/rollout.log" | tail -n 6
wait $BUILD
tail -n 1 "$OUT/deepep.log"
for compute in torch triton; do
    step "ll-$compute" $(( $(left) / 2 + 20 )) python3 -m pytest -q -s -p no:cacheprovider -rs \
        "tests/workloads/test_deepep_ll_gpu.py::test_low_latency_decode_on_two_ranks_gives_the_single_gpu_engines_rows[$compute-shared]" \
        >> "$OUT/deepep.log" 2>&1
done
grep -h "DEEPEP_LL_RESULT\|passed\|failed" "$OUT/deepep.log" | tail -n 6
echo "total $((SECONDS - START)) s"
