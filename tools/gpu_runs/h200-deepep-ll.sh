#!/bin/bash
# deepep-ll (issue 10 item 7): an expert-parallel server's decode over DeepEP's low-latency kernels, on one H200.
# Runs from the repository root; needs .fetched/DeepEP (DeepEP V1 at 567632d) and .whl/ (git-ignored: cp312 wheels of fastapi, uvicorn, pydantic and their dependencies) carried.
#  1. wheels (fastapi, pydantic, uvicorn...) into /tmp/site; the package through the /tmp/shim links;
#  2. DeepEP V1 stock built from the carried source (images/scripts/build_deepep.sh, ~80 s), its wheel into /tmp/deepep;
#  3. tests/workloads/test_deepep_ll_gpu.py[torch]: 2 ranks sharing cuda:0 over gloo, decode over low_latency_dispatch /
#     low_latency_combine, prefill over the all-to-all; every row's tokens and logprobs against the single-GPU engine,
#     and the all-to-all decode of the same rows; the measured differences printed as a DEEPEP_LL_RESULT JSON line;
#  4. tests/rl/test_sharded_rollout.py: the sharded HTTP server, 2 torchrun ranks sharing cuda:0 over gloo (its model,
#     hidden 32, is refused by DeepEP LL: the all-to-all path; the reason is in the rank log), against one process;
#     the streaming case only if httpx is importable;
#  5. test_deepep_ll_gpu.py[triton] if time is left.
# Expected: ~200 s (hard limit 235 s in all). Timings from ranks time-sharing one GPU mean nothing: correctness only.
# Results in $OUT (5 files): steps.txt, build.log (wheels + DeepEP build), ll-torch.log, sharded.log, ll-triton.log.
set -u
BUDGET=235
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
step wheels 40 python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/build.log" 2>&1
export PYTHONPATH=/tmp/deepep:/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One node, no NIC use: NVSHMEM reaches the other rank's buffer peer to peer (REFERENCE.md, checked on this GPU).
export NVSHMEM_REMOTE_TRANSPORT=none

step build 150 bash -c build_deepep >> "$OUT/build.log" 2>&1
tail -3 "$OUT/build.log"

step ll-torch $(( $(left) - 75 )) python3 -m pytest -q -s -p no:cacheprovider -rs \
    "tests/workloads/test_deepep_ll_gpu.py::test_low_latency_decode_on_two_ranks_gives_the_single_gpu_engines_rows[torch-shared]" \
    > "$OUT/ll-torch.log" 2>&1
grep -h "DEEPEP_LL_RESULT\|passed\|failed\|skipped\|Error" "$OUT/ll-torch.log" | tail -6

select="not nothing"
python3 -c 'import httpx' 2>/dev/null || select="not streams"
step sharded $(( $(left) - 40 )) python3 -m pytest -q -p no:cacheprovider -rs -k "$select" tests/rl/test_sharded_rollout.py \
    > "$OUT/sharded.log" 2>&1
tail -4 "$OUT/sharded.log"

step ll-triton $(( $(left) - 3 )) python3 -m pytest -q -s -p no:cacheprovider -rs \
    "tests/workloads/test_deepep_ll_gpu.py::test_low_latency_decode_on_two_ranks_gives_the_single_gpu_engines_rows[triton-shared]" \
    > "$OUT/ll-triton.log" 2>&1
grep -h "DEEPEP_LL_RESULT\|passed\|failed\|skipped\|Error" "$OUT/ll-triton.log" | tail -6
echo "total $((SECONDS - START)) s"
