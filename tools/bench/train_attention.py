"""The trainer's causal attention per backend on one GPU (`moerl bench-train-attention`): forward + backward of one
packed sequence through torch's SDPA on the flash kernel and on cuDNN's, at the attention shapes of Qwen3-30B-A3B
(32 / 4 heads of 128) and Qwen3-235B-A22B (64 / 4), for a range of sequence lengths. Per case: the first call's
milliseconds (cuDNN builds its plan for a new shape there), the median of the next ones, TFLOP/s (the causal half
of 4 x n^2 x D x H, forward x 3.5 with its backward), and cuDNN's largest output and gradient differences from
flash relative to the largest value. What model/transformer.py's CUDNN_MIN_TOKENS is chosen from: the length from
which one call's saving pays for a new plan.

    python3 -m moe_rl_eks.tools.bench.train_attention --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_rl_eks.core.models import known_model

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def fwd_bwd(q, k, v, backend: SDPBackend) -> tuple[float, tuple[torch.Tensor, ...]]:
    """One forward + backward on `backend` alone: (milliseconds, (out, dq, dk, dv))."""
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, (out.detach(), q.grad, k.grad, v.grad)


def case(model: str, length: int, repeats: int) -> dict:
    c = known_model(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, c.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for heads in (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads))
    flops = 3.5 * 2 * length * length * c.head_dim * c.num_attention_heads  # causal half of 4 n^2 D H, x3.5 with bwd
    row = {"model": model, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "length": length}
    results = {}
    for name, backend in BACKENDS.items():
        try:
            first, results[name] = fwd_bwd(q, k, v, backend)
            ms = statistics.median(fwd_bwd(q, k, v, backend)[0] for _ in range(repeats))
            row[name] = {"first_ms": first, "ms": ms, "tflops": flops / ms / 1e9}
        except RuntimeError as e:  # the backend does not take this shape
            row[name] = {"error": str(e).splitlines()[0][:200]}
    if len(results) == 2:
        row["cudnn_rel_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                    for a, b in zip(results["cudnn"], results["flash"]))
        row["cudnn_saving_ms"] = row["flash"]["ms"] - row["cudnn"]["ms"]
        row["cudnn_plan_ms"] = row["cudnn"]["first_ms"] - row["cudnn"]["ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench-train-attention needs a CUDA GPU (it compares torch's CUDA attention backends)")
    rows = [case(m, int(n), args.repeats) for m in args.models.split(",") for n in args.lengths.split(",")]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; cuDNN {torch.backends.cudnn.version()}")
    print("| model | length | flash ms | flash TFLOP/s | cuDNN ms | cuDNN TFLOP/s | cuDNN first call ms | "
          "saving per call ms | cuDNN vs flash (rel. max diff) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, d = r["flash"], r["cudnn"]
        if "error" in f or "error" in d:
            cells = [x.get("error") or f"{x['ms']:.2f}" for x in (f, d)]
            print(f"| {r['model']} | {r['length']:,} | {cells[0]} | | {cells[1]} | | | | |")
            continue
        print(f"| {r['model']} | {r['length']:,} | {f['ms']:.2f} | {f['tflops']:.0f} | {d['ms']:.2f} | "
              f"{d['tflops']:.0f} | {d['first_ms']:.1f} | {r['cudnn_saving_ms']:.2f} | {r['cudnn_rel_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
