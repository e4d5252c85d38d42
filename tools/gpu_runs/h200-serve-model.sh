#!/bin/bash
# Issue 25 (item 5) on one H200 (device tool): `serve-rollout --model DIR` at its defaults (triton, 256 rows, the KV
# cache within 0.9 of the GPU) against bench-server at the same shape, and the checkpoint's cold load against
# dd iflag=direct of the same files. 24 layers of the Qwen3-30B-A3B shape with random weights (30 GB, the issue's
# checkpoint shape) are written to the root disk (/var/tmp) by bench-load, which then times dd, the replica's
# O_DIRECT read and the server's first load; then the server is started on that directory (its O_DIRECT read
# bypasses the page cache; its log says how long its load took), bench-server --url sends it the issue's requests
# (groups of n = 8, 128-token prompts, 256 new tokens, 8 and 32 requests in flight), the server stops, and
# bench-server runs its own engine at the same shape. Expected ~5-6 min (budget 480 s). From the repository root with the machine's python3; carry .whl/.
# Results in $OUT: steps.txt, bench-load.{json,log}, and per length serve-model-LEN.log, served-LEN.{json,log};
# bench-server.{json,log}. LENGTHS="default 384" BUDGET=570 bisects the row width (two server starts).
set -u
BUDGET=${BUDGET:-480}
# shellcheck source=tools/gpu_runs/budget.sh
source "$(dirname "$0")/budget.sh"
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
if [ -d .whl ]; then python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
D=/var/tmp/moerl-serve-model
SHAPE=(--concurrency 8 32 --n 8 --max-tokens 256)
step bench-load 260 python3 -m moe_rl_eks.tools.bench.load --dir "$D" --layers 24 --keep \
    --json "$OUT/bench-load.json" > "$OUT/bench-load.log" 2>&1
cat "$OUT/bench-load.log"
# LENGTHS: the served row's --max-model-len per server start ("default": the checkpoint's 40,960 positions). 8 in
# flight ran at 0.85x of bench-server (whose rows are 384 positions wide) and 32 at 0.98x: "default 384" tells
# whether the row's width (the engine's block tables, decode attention's split over positions) is the cause.
for len in ${LENGTHS:-default}; do
    flag=() && [ "$len" != default ] && flag=(--max-model-len "$len")
    python3 -m moe_rl_eks.tools.cli serve-rollout --model "$D" --host 127.0.0.1 --port 18777 --max-new-tokens 256 \
        "${flag[@]}" > "$OUT/serve-model-$len.log" 2>&1 &
    server=$!
    t=$SECONDS
    until curl -sf http://127.0.0.1:18777/ready > /dev/null; do
        if ! kill -0 $server 2> /dev/null || [ $((SECONDS - t)) -gt 150 ]; then echo "server not ready"; break; fi
        sleep 1
    done
    echo "serve-rollout --model ($len): ready after $((SECONDS - t)) s" | tee -a "$OUT/steps.txt"
    grep -i "serving\|memory:\|loaded weight" "$OUT/serve-model-$len.log"
    step "served-$len" $(( $(left) / 2 )) python3 -m moe_rl_eks.tools.bench.server --model qwen3 --layers 24 \
        "${SHAPE[@]}" --url http://127.0.0.1:18777 --json "$OUT/served-$len.json" > "$OUT/served-$len.log" 2>&1
    tail -n 6 "$OUT/served-$len.log"
    kill $server; wait $server 2> /dev/null
done
rm -rf "$D"
step bench-server $(( $(left) - 5 )) python3 -m moe_rl_eks.tools.bench.server --model qwen3 --layers 24 \
    --compute triton "${SHAPE[@]}" --json "$OUT/bench-server.json" > "$OUT/bench-server.log" 2>&1
tail -n 10 "$OUT/bench-server.log"
