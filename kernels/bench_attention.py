"""The rollout engine's paged attention kernels on one GPU, at Qwen3-30B-A3B's attention shape (32 query heads, 4 kv
heads of 128), against PyTorch's SDPA on the same numbers laid out densely (no block table: the best case for it).

- prefill: several prompts packed with no padding, causal, read through block tables of 16-position blocks
  (`prefill_attention`), against SDPA over the prompts padded to the longest (is_causal, flash/cuDNN backend) and
  SDPA once per prompt. TFLOP/s counts the causal products actually needed (2 x 2 x D x sum of n(n+1)/2 per head).
- decode: one query per row over each row's context through its block table (`decode_attention`), against SDPA over
  dense [B, H_kv, context, D] keys/values. GB/s counts the keys and values read once.

Outputs are checked against SDPA first (relative Frobenius error).

    python3 -m moe_rl_eks.kernels.bench_attention --json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from .bench import rel_err
from .decode_attention import decode_attention
from .prefill_attention import prefill_attention, prefill_tiles

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16


def _ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _paged(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Keys/values of rows of these lengths in a shuffled block pool, their tables, and each row's dense keys and
    values [2, H_kv, n, D]."""
    per_row = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(per_row), device=device)
    keys = torch.randn(sum(per_row), PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    tables = torch.zeros(len(lengths), max(per_row), dtype=torch.int32, device=device)
    dense, at = [], 0
    for r, (n, blocks) in enumerate(zip(lengths, per_row)):
        ids = order[at:at + blocks]
        at += blocks
        tables[r, :blocks] = ids.int()
        dense.append(torch.stack([keys[ids].flatten(0, 1)[:n], values[ids].flatten(0, 1)[:n]]).transpose(1, 2))
    return keys, values, tables, dense


def bench_prefill(prompts: int, length: int, device) -> dict:
    lengths = [length - (i * length // (4 * prompts)) for i in range(prompts)]  # uneven, up to 25 % shorter
    keys, values, tables, dense = _paged(lengths, device)
    slots = torch.cat([torch.full((n,), r, device=device) for r, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    starts = [sum(lengths[:r]) for r in range(prompts)]
    tiles = prefill_tiles(list(zip(starts, lengths)), device)
    q = torch.randn(len(slots), HEADS, DIM, device=device, dtype=torch.bfloat16)
    longest = max(lengths)
    padded_q = torch.zeros(prompts, HEADS, longest, DIM, device=device, dtype=torch.bfloat16)
    padded_kv = torch.zeros(2, prompts, KV_HEADS, longest, DIM, device=device, dtype=torch.bfloat16)
    for r, (s, n) in enumerate(zip(starts, lengths)):
        padded_q[r, :, :n] = q[s:s + n].transpose(0, 1)
        padded_kv[:, r, :, :n] = dense[r]

    def ours():
        return prefill_attention(q, keys, values, tables, slots, positions, tiles)

    def padded():
        return F.scaled_dot_product_attention(padded_q, padded_kv[0], padded_kv[1], is_causal=True, enable_gqa=True)

    def per_prompt():
        return [F.scaled_dot_product_attention(padded_q[r:r + 1, :, :n], padded_kv[0, r:r + 1, :, :n],
                                               padded_kv[1, r:r + 1, :, :n], is_causal=True, enable_gqa=True)
                for r, n in enumerate(lengths)]

    want = torch.cat([o[0].transpose(0, 1) for o in per_prompt()])
    err = rel_err(ours(), want)
    flops = 4 * DIM * HEADS * sum(n * (n + 1) / 2 for n in lengths)
    out = {"kernel": "prefill", "prompts": prompts, "tokens": sum(lengths), "longest": longest, "rel_err": err}
    for name, fn in (("paged_packed", ours), ("sdpa_padded", padded), ("sdpa_per_prompt", per_prompt)):
        ms = _ms(fn)
        out[f"{name}_ms"], out[f"{name}_tflops"] = ms, flops / ms / 1e9
    return out


def bench_decode(rows: int, context: int, device) -> dict:
    lengths = [context] * rows
    keys, values, tables, dense = _paged(lengths, device)
    q = torch.randn(rows, HEADS, DIM, device=device, dtype=torch.bfloat16)
    slots = torch.arange(rows, device=device)
    lens = torch.full((rows,), context, device=device)
    k = torch.stack([d[0] for d in dense])
    v = torch.stack([d[1] for d in dense])

    def ours():
        return decode_attention(q, keys, values, tables, slots, lens)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

    err = rel_err(ours(), sdpa())
    read = 2 * rows * context * KV_HEADS * DIM * 2
    out = {"kernel": "decode", "rows": rows, "context": context, "rel_err": err}
    for name, fn in (("paged", ours), ("sdpa_dense", sdpa)):
        ms = _ms(fn)
        out[f"{name}_ms"], out[f"{name}_gb_s"] = ms, read / ms / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", nargs="+", default=["64x128", "8x1024", "32x1024"], metavar="PROMPTSxLENGTH")
    parser.add_argument("--decode", nargs="+", default=["1x1280", "64x384", "64x1280", "256x384", "256x1280"],
                        metavar="ROWSxCONTEXT")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = []
    print("| kernel | shape | ours ms | SDPA ms (dense) | SDPA per prompt ms | ours TFLOP/s or GB/s | rel. error |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.prefill:
        r = bench_prefill(*map(int, spec.split("x")), device)
        results.append(r)
        print(f"| prefill (packed, paged) | {r['prompts']} prompts, {r['tokens']} tokens | "
              f"{r['paged_packed_ms']:.3f} | "
              f"{r['sdpa_padded_ms']:.3f} (padded) | {r['sdpa_per_prompt_ms']:.3f} | "
              f"{r['paged_packed_tflops']:.0f} TFLOP/s | {r['rel_err']:.1e} |", flush=True)
    for spec in args.decode:
        r = bench_decode(*map(int, spec.split("x")), device)
        results.append(r)
        print(f"| decode (paged, split-K) | {r['rows']} rows x {r['context']} | {r['paged_ms']:.3f} | "
              f"{r['sdpa_dense_ms']:.3f} | - | {r['paged_gb_s']:.0f} GB/s | {r['rel_err']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
