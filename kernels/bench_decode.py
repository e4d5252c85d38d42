"""A decode step's MoE layer on one GPU: the decode kernels (expert_decode.py) against the training path (route,
permute, grouped GEMM, combine), at few tokens per step, to place the engine's cut-over (DECODE_MAX_TOKENS); and
the step's dense projections (q/k/v, o, router, lm_head) through cuBLAS and through gemv.py.

Each path runs `--layers` layers of distinct weights (as a decode step walks the model, so no layer finds its
experts in L2 from the previous one) captured in one CUDA graph, replayed; time per layer = replay time / layers.
GB/s counts the bytes of the distinct experts the step touches (gate, up, down), read once. Outputs are checked
against each other first (relative Frobenius error; routing equal).

    python3 -m moe_rl_eks.kernels.bench_decode --tokens 1 2 4 8 16 32 64 --json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from .backend import TritonCompute
from .bench import SHAPES, rel_err
from .expert_decode import _KERNELS, DECODE_MAX_TOKENS, decode_experts
from .gemv import _gemv_kernel, gemv


def _graph_ms(fn, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def run(tokens: list[int], layers: int) -> list[dict]:
    shape = SHAPES["qwen3"]
    spec, E, h, width = shape.spec, shape.experts, shape.hidden, shape.width
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device="cuda") * scale).to(torch.bfloat16)

    weights = [(randn(E, h, scale=h ** -0.5), randn(E, 2 * width, h, scale=h ** -0.5),
                randn(E, h, width, scale=width ** -0.5)) for _ in range(layers)]
    compute = TritonCompute()
    rows = []
    for t in tokens:
        x = randn(t, h)

        def grouped():
            for router, w13, w2 in weights:
                logits = F.linear(x, router)
                w, ids = compute.route(logits, spec, None)
                x_sorted, counts, handle = compute.permute(x, ids, E)
                compute.unpermute(compute.experts(x_sorted, counts, w13, w2), w, handle)

        def decode():
            for router, w13, w2 in weights:
                decode_experts(x, F.linear(x, router), spec, None, w13, w2)

        router, w13, w2 = weights[0]
        logits = F.linear(x, router)
        got, _, got_ids = decode_experts(x, logits, spec, None, w13, w2)
        w, ids = compute.route(logits, spec, None)
        x_sorted, counts, handle = compute.permute(x, ids, E)
        want = compute.unpermute(compute.experts(x_sorted, counts, w13, w2), w, handle)
        touched = sum(len(torch.unique(compute.route(F.linear(x, r), spec, None)[1])) for r, _, _ in weights) / layers
        bytes_per_layer = touched * 3 * width * h * 2
        ms_grouped, ms_decode = _graph_ms(grouped) / layers, _graph_ms(decode) / layers
        row = {"tokens": t, "experts_touched": touched, "grouped_us": ms_grouped * 1e3, "decode_us": ms_decode * 1e3,
               "grouped_GBps": bytes_per_layer / ms_grouped / 1e6, "decode_GBps": bytes_per_layer / ms_decode / 1e6,
               "rel_err_vs_grouped": rel_err(got, want), "ids_equal": bool(torch.equal(got_ids, ids)),
               "up_config": str(_KERNELS[False][0].best_config), "down_config": str(_KERNELS[False][1].best_config)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# the Qwen3-30B-A3B decode step's products: name -> (N, K)
PROJECTIONS = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}


def run_projections(tokens: list[int], copies: int) -> list[dict]:
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        count = 2 if name == "lm_head" else copies
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(count)]
        for t in tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            err = rel_err(gemv(x, weights[0]), F.linear(x, weights[0]))
            ms_cublas = _graph_ms(lambda: [F.linear(x, w) for w in weights]) / count
            ms_gemv = _graph_ms(lambda: [gemv(x, w) for w in weights]) / count
            row = {"projection": name, "N": n, "K": k, "tokens": t, "cublas_us": ms_cublas * 1e3,
                   "gemv_us": ms_gemv * 1e3, "cublas_GBps": n * k * 2 / ms_cublas / 1e6,
                   "gemv_GBps": n * k * 2 / ms_gemv / 1e6, "rel_err": err, "config": str(_gemv_kernel.best_config)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del weights
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = run(args.tokens, args.layers)
    projections = run_projections([t for t in args.tokens if t <= 16], args.layers)
    print(f"\nMoE layer of a decode step, Qwen3-30B-A3B shape, {torch.cuda.get_device_name()}; "
          f"engine cut-over DECODE_MAX_TOKENS = {DECODE_MAX_TOKENS}")
    print("| tokens | experts touched | grouped path us | decode kernels us | grouped GB/s | decode GB/s | rel err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['experts_touched']:.1f} | {r['grouped_us']:.1f} | {r['decode_us']:.1f} | "
              f"{r['grouped_GBps']:.0f} | {r['decode_GBps']:.0f} | {r['rel_err_vs_grouped']:.1e} |")
    print("\n| projection | N x K | tokens | cuBLAS us | gemv us | cuBLAS GB/s | gemv GB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in projections:
        print(f"| {r['projection']} | {r['N']} x {r['K']} | {r['tokens']} | {r['cublas_us']:.1f} | "
              f"{r['gemv_us']:.1f} | {r['cublas_GBps']:.0f} | {r['gemv_GBps']:.0f} | {r['rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "moe": rows, "projections": projections}, f,
                      indent=1)


if __name__ == "__main__":
    main()
