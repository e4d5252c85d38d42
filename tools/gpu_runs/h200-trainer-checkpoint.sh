#!/bin/bash
# Issue 25 (item 1) on one H200 (device tool): the trainer's asynchronous DCP checkpoint over its own
# "cpu:gloo,cuda:nccl" process group. tests/rl/test_trainer_gpu.py: a one-rank trainer process writes a checkpoint,
# is SIGKILLed after the commit and resumes (step, weights, AdamW state, one more fused step), plus the bf16 step;
# and the backend choice of init_trainer_process_group. Expected under 2 min. From the repository root with the
# machine's python3; carry .whl/ (git-ignored cp312 wheels the machine lacks) where it exists.
# Log: $OUT/trainer-checkpoint.log when OUT is set; the exit status is pytest's.
set -euo pipefail
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
if [ -d .whl ]; then python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
tests() {
    timeout --kill-after=5 300 python3 -m pytest -q tests/rl/test_trainer_gpu.py \
        tests/rl/test_trainer.py::test_the_trainer_process_group_has_a_cpu_backend_beside_nccl_for_async_checkpoints \
        -p no:cacheprovider
}
if [ -n "${OUT:-}" ]; then tests 2>&1 | tee "$OUT/trainer-checkpoint.log"; else tests; fi
