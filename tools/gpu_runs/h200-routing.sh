#!/bin/bash
# Issue 26 (item 3) on one H200 (device tool): routing replay through the routing store with the engine and the
# trainer on the GPU. tests/rl/test_routing_replay.py: an in-process rollout server on cuda:0 writes each choice's
# routed experts to the store, the orchestrator batches references, the trainer (cuda:0) reads them and its forward
# replays exactly those experts; the batch's objects are deleted after the checkpoint past its step. Plus the
# trainer's replay against the rollout's logprobs and the two-rank read of each rank's share (ranks sharing cuda:0
# over gloo), and the server's answer read back from the store. Expected under 3 min. From the repository root with
# the machine's python3; carry .whl/ (git-ignored cp312 wheels the machine lacks) where it exists.
# Log: $OUT/routing.log when OUT is set; the exit status is pytest's.
set -euo pipefail
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
package_env
tests() {
    timeout --kill-after=5 400 python3 -m pytest -q tests/rl/test_routing_replay.py tests/rl/test_routing_store.py \
        tests/rl/test_trainer.py tests/rl/test_rollout_server.py -k routing -p no:cacheprovider
}
if [ -n "${OUT:-}" ]; then tests 2>&1 | tee "$OUT/routing.log"; else tests; fi
