#!/bin/bash
# Where the GPU waits during generation (issue 25 item 4's GPU busy), on one H200 (device tool): the async
# scheduling tests on CUDA, then bench-rl --gpu's standalone generation (8 layers of the Qwen3-30B-A3B shape, 512
# rows in groups of 16, 256-token prompts, lengths drawn with mean 2,000 up to 8,192, 256 at once, CUDA graphs)
# with rollout.async_scheduling off and then on: per decode step the device's ms and the host's ms between steps,
# and the 100 ms nvidia-smi samples of each generation (share at >= 90 % and mean utilisation). Estimated: tests
# ~60 s, model ~10 s, each generation ~60-65 s after ~30 s of graph capture. From the repository root (carry
# .whl/): BUDGET=420 bash tools/gpu_runs/h200-engine-idle.sh; results in $OUT: steps.txt, tests.log,
# engine-idle.{json,log}.
set -u
BUDGET=${BUDGET:-420}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
package_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/rl/test_async_scheduling.py \
    tests/rl/test_engine_host_time.py > "$OUT/tests.log" 2>&1
tail -n 3 "$OUT/tests.log"
step engine-idle "$(left)" python3 -m moe_rl_eks.tools.cli bench-engine-host --gpu --layers 8 --rows 512 --slots 256 \
    --n 16 --prompt-tokens 256 --new-tokens 8192 --mean-tokens 2000 --json "$OUT/engine-idle.json" \
    > "$OUT/engine-idle.log" 2>&1
tail -n 4 "$OUT/engine-idle.log"
exit 0
