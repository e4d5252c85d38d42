"""The exact numerics mode's kernels against the fast ones on one GPU, at Qwen3-30B-A3B's shape: the dense
projections and the LM head (invariant_matmul.py against the engine's few-row product or cuBLAS), decode attention
over the paged cache (the prefill kernel with one-token tiles against split-KV flash-decoding) and the experts'
forward (the grouped GEMM on its fixed tile against its tuned ones). Per case: median milliseconds of each
(triton.testing.do_bench), exact / fast, and whether the exact kernel gave the case's first row the same bits as it
does alone (the property the mode buys).

    python3 -m moe_rl_eks.kernels.bench_exact --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from .bench import SHAPES
from .decode_attention import decode_attention
from .gemv import decode_linear
from .grouped_gemm import swiglu_experts
from .invariant_attention import invariant_decode_attention
from .invariant_matmul import invariant_matmul

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 128, 151936  # Qwen3-30B-A3B's attention and vocabulary
PAGE = 16


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _randn(g, *size, scale=1.0):
    return (torch.randn(*size, generator=g, device="cuda") * scale).to(torch.bfloat16)


def projections(g, rows: list[int]):
    hidden = SHAPES["qwen3"].hidden
    for name, n, k in (("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, hidden), ("o_proj", hidden, HEADS * HEAD_DIM),
                       ("lm_head", VOCAB, hidden)):
        w = _randn(g, n, k, scale=k ** -0.5)
        for m in rows:
            x = _randn(g, m, k)
            # the engine's product: gemv where it beats cuBLAS at a decode step's few rows, else cuBLAS
            fast = decode_linear if m <= 16 else F.linear
            same = torch.equal(invariant_matmul(x, w)[:1], invariant_matmul(x[:1], w))
            yield {"case": f"{name} [{n}x{k}]", "rows": m, "fast_ms": _ms(lambda: fast(x, w)),
                   "exact_ms": _ms(lambda: invariant_matmul(x, w)), "row_bits_equal": same}


def attention(g, batches: list[int], context: int):
    for b in batches:
        blocks = b * context // PAGE
        keys, values = (_randn(g, blocks + 1, PAGE, KV_HEADS, HEAD_DIM) for _ in range(2))
        tables = torch.randperm(blocks, device="cuda").view(b, -1).to(torch.int32)
        slots = torch.arange(b, device="cuda")
        lengths = torch.full((b,), context, device="cuda")
        q = _randn(g, b, HEADS, HEAD_DIM)
        same = torch.equal(invariant_decode_attention(q, keys, values, tables, slots, lengths)[:1],
                           invariant_decode_attention(q[:1], keys, values, tables, slots[:1], lengths[:1]))
        yield {"case": f"decode attention, {context} positions", "rows": b,
               "fast_ms": _ms(lambda: decode_attention(q, keys, values, tables, slots, lengths)),
               "exact_ms": _ms(lambda: invariant_decode_attention(q, keys, values, tables, slots, lengths)),
               "row_bits_equal": same}


def experts(g, tokens: list[int]):
    shape = SHAPES["qwen3"]
    e, h, width, k = shape.experts, shape.hidden, shape.width, shape.spec.top_k
    w13, w2 = _randn(g, e, 2 * width, h, scale=h ** -0.5), _randn(g, e, h, width, scale=width ** -0.5)
    with torch.no_grad():
        for t in tokens:
            ids = torch.randint(0, e, (t * k,), generator=g, device="cuda").sort().values
            counts = torch.bincount(ids, minlength=e)
            x = _randn(g, t * k, h)
            alone = torch.zeros_like(counts)  # the batch's first row, the first of its expert's rows, alone
            alone[ids[0]] = 1
            same = torch.equal(swiglu_experts(x, counts, w13, w2, exact=True)[:1],
                               swiglu_experts(x[:1], alone, w13, w2, exact=True))
            yield {"case": f"experts forward [{e}x{2 * width}x{h}], top-{k}", "rows": t * k,
                   "fast_ms": _ms(lambda: swiglu_experts(x, counts, w13, w2)),
                   "exact_ms": _ms(lambda: swiglu_experts(x, counts, w13, w2, exact=True)),
                   "row_bits_equal": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'case':<44} {'rows':>6} {'fast ms':>9} {'exact ms':>9} {'exact/fast':>10}  row bits equal")
    # each row printed and recorded as it is measured: a run stopped by a time limit keeps what it measured
    for r in itertools.chain(projections(g, args.rows), attention(g, args.batches, args.context),
                             experts(g, args.tokens)):
        rows.append(r)
        print(f"{r['case']:<44} {r['rows']:>6} {r['fast_ms']:>9.4f} {r['exact_ms']:>9.4f} "
              f"{r['exact_ms'] / r['fast_ms']:>10.2f}  {'yes' if r['row_bits_equal'] else 'NO'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
