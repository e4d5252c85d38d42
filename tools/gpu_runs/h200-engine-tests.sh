#!/bin/bash
# The engine's CUDA tests, the training grouped GEMM with float32 and bf16 operands against float32 torch, and the
# sharded server's tests with two ranks on cuda:0 over gloo, on one H200 (device tool). From the repository root with the
# machine's python3; needs .whl/ (git-ignored cp312 wheels of fastapi, uvicorn, pydantic...) carried; logs in $OUT.
set -u
mkdir -p /tmp/shim/moe_rl_eks && for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1
S=$SECONDS
timeout --kill-after=5 115 python3 -m pytest tests/rl/test_generation.py tests/rl/test_weight_staging.py -q -p no:cacheprovider -k "cuda or triton or gpu" > "$OUT"/tests-generation.log 2>&1
echo "generation: rc $? after $((SECONDS-S)) s"; tail -n 3 "$OUT"/tests-generation.log
timeout --kill-after=5 60 python3 - > "$OUT"/fp32-grouped-gemm.log 2>&1 <<'PY'
import torch
from moe_rl_eks.kernels.grouped_gemm import swiglu_experts
torch.manual_seed(0)
E, H, W = 8, 256, 128
counts = torch.tensor([5, 0, 17, 3, 40, 1, 9, 2], device="cuda", dtype=torch.int32)
n = int(counts.sum())
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(n, H, device="cuda", dtype=dtype)
    w13 = torch.randn(E, 2 * W, H, device="cuda", dtype=dtype) / H ** 0.5
    w2 = torch.randn(E, H, W, device="cuda", dtype=dtype) / W ** 0.5
    y = swiglu_experts(x, counts, w13, w2).float()
    ref, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c].float(); start += c
        g, u = (xe @ w13[e].float().T).chunk(2, dim=-1)
        ref.append((torch.nn.functional.silu(g) * u) @ w2[e].float().T)
    ref = torch.cat(ref)
    print(dtype, "max rel err", ((y - ref).abs().max() / ref.abs().max()).item())
PY
echo "fp32 grouped gemm: rc $? after $((SECONDS-S)) s"; cat "$OUT"/fp32-grouped-gemm.log | tail -n 4
timeout --kill-after=5 $((265 - (SECONDS-S))) python3 -m pytest -q -p no:cacheprovider tests/rl/test_sharded_rollout.py > "$OUT"/sharded.log 2>&1
echo "sharded: rc $? after $((SECONDS-S)) s"; tail -n 3 "$OUT"/sharded.log
