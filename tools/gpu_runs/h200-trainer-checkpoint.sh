#!/bin/bash
# Issue 25 (item 1) on one H200 (device tool): the trainer's asynchronous DCP checkpoint over its own
# "cpu:gloo,cuda:nccl" process group. tests/rl/test_trainer_gpu.py: a one-rank trainer process writes a checkpoint,
# is SIGKILLed after the commit and resumes (step, weights, AdamW state, one more fused step), plus the bf16 step;
# and the backend choice of init_trainer_process_group. Expected under 2 min. From the repository root with the
# machine's python3; carry .whl/ (git-ignored cp312 wheels the machine lacks) where it exists.
# Log: $OUT/trainer-checkpoint.log when OUT is set; the exit status is pytest's.
set -euo pipefail
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
package_env
tests() {
    timeout --kill-after=5 300 python3 -m pytest -q tests/rl/test_trainer_gpu.py \
        tests/rl/test_trainer.py::test_the_trainer_process_group_has_a_cpu_backend_beside_nccl_for_async_checkpoints \
        -p no:cacheprovider
}
if [ -n "${OUT:-}" ]; then tests 2>&1 | tee "$OUT/trainer-checkpoint.log"; else tests; fi
