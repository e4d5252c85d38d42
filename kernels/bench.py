"""Benchmark and real-shape check of the MoE layer's compute backends on one GPU (`make bench-kernels`).

Measures, in one run: the dense bf16 matmul ceiling and device copy bandwidth; then the whole MoE layer (router
linear, routing, permutation, SwiGLU experts, weighted combine), forward and forward+backward, for the baseline
(`torch`: the project's torch._grouped_mm backend, loaded by name so kernels/ never imports workloads/) and the
`triton` backend, at the Qwen3-30B-A3B layer and one DeepSeek-V3 EP8 rank, with balanced and skewed routing
(some experts empty). Times are medians of CUDA-event timings after warm-up (triton.testing.do_bench). Before
timing, each shape is checked against an fp32 reference (relative Frobenius error, METHOD.md).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from .backend import TritonCompute
from .permute import expert_layout

DEFAULT_BASELINE = "moe_rl_eks.workloads.moe.torch_compute:TorchCompute"


@dataclass(frozen=True)
class Spec:
    """Duck-typed RoutingSpec (the contract's dataclass lives in workloads/, which kernels/ must not import)."""

    top_k: int
    scoring: str
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scaling: float = 1.0


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    experts: int
    hidden: int
    width: int
    spec: Spec

    @property
    def rows(self) -> int:
        return self.tokens * self.spec.top_k

    @property
    def forward_flop(self) -> float:  # three GEMMs: gate, up (2I wide) and down
        return 6.0 * self.rows * self.hidden * self.width


SHAPES = {
    "qwen3": Shape("Qwen3-30B-A3B", 16384, 128, 2048, 768, Spec(top_k=8, scoring="softmax")),
    # one EP8 rank of DeepSeek-V3: 8192 tokens x top-8 = 65536 routed rows over its 32 local experts; sigmoid
    # scoring, bias and group-limited selection (8 groups of 4, best 4 groups) as DeepSeek-V3 routes
    "dsv3": Shape("DeepSeek-V3 EP8 rank", 8192, 32, 7168, 2048,
                  Spec(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, scaling=2.5)),
}


def load_backend(path: str):
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)()


def make_inputs(shape: Shape, skewed: bool, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    h, width, E = shape.hidden, shape.width, shape.experts

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(torch.bfloat16)

    # Skew: a linear preference over experts (the first get several times the average load) and the last
    # eighth of experts never chosen (logits pushed to -30).
    offset = torch.zeros(E, device=device)
    if skewed:
        offset = torch.linspace(2.0, 0.0, E, device=device)
        offset[E - E // 8:] = -30.0
    return dict(
        x=randn(shape.tokens, h),
        router=randn(E, h, scale=h ** -0.5),
        w13=randn(E, 2 * width, h, scale=h ** -0.5),
        w2=randn(E, h, width, scale=width ** -0.5),
        bias=(torch.randn(E, generator=g, device=device) * 0.01 if shape.spec.scoring == "sigmoid" else None),
        offset=offset,
    )


def layer(compute, shape: Shape, x, router, w13, w2, bias, offset):
    logits = F.linear(x, router).float() + offset
    weights, ids = compute.route(logits, shape.spec, bias)
    x_sorted, counts, handle = compute.permute(x, ids, shape.experts)
    return compute.unpermute(compute.experts(x_sorted, counts, w13, w2), weights, handle)


def reference_layer(shape: Shape, x, router, w13, w2, offset, ids):
    """fp32 layer on given routing (the kernels' own choice, checked separately against the baseline's)."""
    width = shape.width
    logits = F.linear(x.float(), router.float()) + offset
    scores = logits.softmax(-1) if shape.spec.scoring == "softmax" else logits.sigmoid()
    w = scores.gather(1, ids)
    if shape.spec.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * shape.spec.scaling
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // shape.spec.top_k
    counts = torch.bincount(flat, minlength=shape.experts).tolist()
    x_sorted = x.float()[token]
    outs, start = [], 0
    for e, n in enumerate(counts):
        gate_up = x_sorted[start:start + n] @ w13[e].float().t()
        outs.append((F.silu(gate_up[:, :width]) * gate_up[:, width:]) @ w2[e].float().t())
        start += n
    y = torch.cat(outs) * w.reshape(-1)[order, None]
    return torch.zeros_like(x, dtype=torch.float32).index_add_(0, token, y)


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - want).norm() / want.norm()).item()


def check(shape: Shape, baseline, device: str) -> dict:
    """Triton layer vs fp32 reference: output and gradients of x, router, w13, w2; routing vs the baseline's."""
    torch.manual_seed(1)
    inp = make_inputs(shape, skewed=True, device=device, seed=int(torch.randint(0, 2 ** 31, (1,))))
    params = {k: inp[k].clone().requires_grad_() for k in ("x", "router", "w13", "w2")}
    logits = F.linear(inp["x"], inp["router"]).float() + inp["offset"]
    w_tri, ids_tri = TritonCompute().route(logits, shape.spec, inp["bias"])
    w_base, ids_base = baseline.route(logits, shape.spec, inp["bias"])
    out = layer(TritonCompute(), shape, **params, bias=inp["bias"], offset=inp["offset"])
    g = torch.randn_like(out)
    out.backward(g)
    ref_params = {k: inp[k].clone().requires_grad_() for k in ("x", "router", "w13", "w2")}
    want = reference_layer(shape, **ref_params, offset=inp["offset"], ids=ids_tri)
    want.backward(g.float())
    result = {"ids_equal_baseline": (ids_tri == ids_base).float().mean().item(),
              "weights_vs_baseline": rel_err(w_tri, w_base), "out": rel_err(out, want)}
    for k in params:
        result[f"d_{k}"] = rel_err(params[k].grad, ref_params[k].grad)
    return result


def bench_ms(fn, grad_to_none=None) -> float:
    return triton.testing.do_bench(fn, warmup=100, rep=500, grad_to_none=grad_to_none, return_mode="median")


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    src = torch.randn(2 ** 28, device="cuda")  # 1 GiB, far past the 60 MB L2
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    return {"dense_tflops": 2 * 8192 ** 3 / mm_ms / 1e9, "copy_gbs": 2 * src.numel() * 4 / copy_ms / 1e6}


def kernel_times(fn) -> list[tuple[str, float]]:
    """(kernel name, ms) of each kernel one call of fn launches, in launch order, from torch.profiler's trace."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return [(e["name"].split("(")[0][:48], e["dur"] / 1000) for e in sorted(events, key=lambda e: e["ts"])]


def dense_equivalents(shape: Shape) -> dict:
    """ms of one cuBLAS matmul of each expert GEMM's total size (rows of all experts at once): the rate the
    grouped kernels would reach if grouping cost nothing."""
    n, h, i = shape.rows, shape.hidden, shape.width
    sizes = {"gate_up x@w13^T": (n, h, 2 * i), "down act@w2^T": (n, i, h), "d_act dy@w2": (n, h, i),
             "dx d_gate_up@w13": (n, 2 * i, h), "dw13 d_gate_up^T@x": (2 * i, n, h), "dw2 dy^T@act": (h, n, i)}
    out = {}
    for name, (m, k, n_) in sizes.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n_, device="cuda", dtype=torch.bfloat16)
        out[name] = bench_ms(lambda: a @ b)
    return out


def bench_backend(name: str, compute, shape: Shape, inp: dict, breakdown: bool = False) -> dict:
    params = {k: inp[k].clone().requires_grad_() for k in ("x", "router", "w13", "w2")}
    extra = dict(bias=inp["bias"], offset=inp["offset"])
    leaves = list(params.values())
    grad = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            return layer(compute, shape, **params, **extra)

    def train_step():
        layer(compute, shape, **params, **extra).backward(grad)

    row = {"backend": name, "fwd_ms": bench_ms(forward), "fwdbwd_ms": bench_ms(train_step, grad_to_none=leaves),
           "fwd_peak_mib": peak_mib(forward)}
    for p in leaves:
        p.grad = None
    row["fwdbwd_peak_mib"] = peak_mib(train_step)

    # components, forward only, on this backend's own routing
    x = inp["x"]
    with torch.no_grad():
        logits = F.linear(x, inp["router"]).float() + inp["offset"]
        weights, ids = compute.route(logits, shape.spec, inp["bias"])
        x_sorted, counts, handle = compute.permute(x, ids, shape.experts)
        y_sorted = compute.experts(x_sorted, counts, inp["w13"], inp["w2"])
        row["route_ms"] = bench_ms(lambda: compute.route(logits, shape.spec, inp["bias"]))
        row["permute_ms"] = bench_ms(lambda: compute.permute(x, ids, shape.experts))
        if isinstance(compute, TritonCompute):  # how much of permute is the layout (counting sort) alone
            row["layout_ms"] = bench_ms(lambda: expert_layout(ids, shape.experts))
        row["experts_ms"] = bench_ms(lambda: compute.experts(x_sorted, counts, inp["w13"], inp["w2"]))
        row["unpermute_ms"] = bench_ms(lambda: compute.unpermute(y_sorted, weights, handle))
        row["empty_experts"] = int((counts == 0).sum())
        row["max_expert_rows"] = int(counts.max())
    expert_leaves = [t.detach().clone().requires_grad_() for t in (x_sorted, inp["w13"], inp["w2"])]
    dy_sorted = torch.randn_like(y_sorted)

    def experts_step():
        compute.experts(expert_leaves[0], counts, *expert_leaves[1:]).backward(dy_sorted)

    row["experts_fwdbwd_ms"] = bench_ms(experts_step, grad_to_none=expert_leaves)
    if breakdown:

        def fresh_experts_step():  # no gradient accumulation kernels in the trace
            for t in expert_leaves:
                t.grad = None
            experts_step()

        row["experts_fwdbwd_kernels"] = kernel_times(fresh_experts_step)
    moved = (shape.tokens + shape.rows) * shape.hidden * 2  # bf16 rows read once and written once
    row["permute_gbs"] = moved / row["permute_ms"] / 1e6
    row["unpermute_gbs"] = moved / row["unpermute_ms"] / 1e6
    row["fwd_tflops"] = shape.forward_flop / row["fwd_ms"] / 1e9
    row["fwdbwd_tflops"] = 3 * shape.forward_flop / row["fwdbwd_ms"] / 1e9
    row["experts_tflops"] = shape.forward_flop / row["experts_ms"] / 1e9
    row["experts_fwdbwd_tflops"] = 3 * shape.forward_flop / row["experts_fwdbwd_ms"] / 1e9
    return row


def table(ceil: dict, rows: list[dict]) -> str:
    dense, copy = ceil["dense_tflops"], ceil["copy_gbs"]
    lines = [f"dense bf16 8192^3 matmul: {dense:.0f} TFLOP/s; device copy: {copy:.0f} GB/s (read + write)", "",
             "| shape | routing | backend | fwd ms | fwd TFLOP/s | % dense | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "experts fwd ms (TFLOP/s) | experts fwd+bwd ms (TFLOP/s) | route ms | permute ms (GB/s, % copy) | "
             "combine ms (GB/s, % copy) | peak MiB fwd / fwd+bwd |",
             "|" + "---|" * 14]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['routing']} | {r['backend']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
            f"{100 * r['fwd_tflops'] / dense:.0f} % | {r['fwdbwd_ms']:.2f} | {r['fwdbwd_tflops']:.0f} | "
            f"{r['experts_ms']:.2f} ({r['experts_tflops']:.0f}) | "
            f"{r['experts_fwdbwd_ms']:.2f} ({r['experts_fwdbwd_tflops']:.0f}) | {r['route_ms']:.3f} | "
            f"{r['permute_ms']:.3f} ({r['permute_gbs']:.0f}, {100 * r['permute_gbs'] / copy:.0f} %) | "
            f"{r['unpermute_ms']:.3f} ({r['unpermute_gbs']:.0f}, {100 * r['unpermute_gbs'] / copy:.0f} %) | "
            f"{r['fwd_peak_mib']:.0f} / {r['fwdbwd_peak_mib']:.0f} |")
    by = {(r["shape"], r["routing"], r["backend"]): r for r in rows}
    lines.append("")
    for (shape, routing, backend), r in by.items():
        base = by.get((shape, routing, "torch"))
        if backend == "triton" and base:
            lines.append(f"{shape} {routing}: triton vs torch speed-up fwd {base['fwd_ms'] / r['fwd_ms']:.2f}x, "
                         f"fwd+bwd {base['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x")
    return "\n".join(lines)


def breakdown_table(results: dict) -> str:
    lines = []
    for r in results["rows"]:
        if "experts_fwdbwd_kernels" in r:
            kernels = ", ".join(f"{k} {ms:.3f}" for k, ms in r["experts_fwdbwd_kernels"])
            lines.append(f"{r['shape']} {r['routing']} triton experts fwd+bwd kernels (ms, launch order): {kernels}")
    for shape, dense in results.get("dense_equivalents", {}).items():
        lines.append(f"{shape} cuBLAS on the same total sizes (ms): "
                     + ", ".join(f"{k} {ms:.3f}" for k, ms in dense.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moerl bench-kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3,dsv3", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--routing", default="balanced,skewed")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="module:class of the baseline backend")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 reference check")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each kernel of the experts' fwd+bwd (torch.profiler) and cuBLAS on the same sizes")
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    for s in args.shapes.split(","):
        if s not in SHAPES:
            ap.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
          f"baseline {args.baseline}", flush=True)
    baseline = load_backend(args.baseline)
    results: dict = {"checks": {}, "rows": [], "errors": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    results["ceilings"] = ceilings()
    print(results["ceilings"], flush=True)
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        if not args.no_check:
            try:
                results["checks"][shape.name] = check(shape, baseline, "cuda")
                print(f"check {shape.name}: {results['checks'][shape.name]}", flush=True)
            except Exception:  # keep measuring the rest; the traceback is the report
                results["errors"].append(traceback.format_exc())
                print(results["errors"][-1], flush=True)
            torch.cuda.empty_cache()
        for routing in args.routing.split(","):
            inp = make_inputs(shape, skewed=routing == "skewed", device="cuda")
            for name, compute in (("torch", baseline), ("triton", TritonCompute())):
                try:
                    row = bench_backend(name, compute, shape, inp, breakdown=args.breakdown and name == "triton")
                except Exception:
                    results["errors"].append(traceback.format_exc())
                    print(results["errors"][-1], flush=True)
                    continue
                row.update(shape=shape.name, routing=routing)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
                torch.cuda.empty_cache()
        if args.breakdown:
            results.setdefault("dense_equivalents", {})[shape.name] = dense_equivalents(shape)
    save()
    print(table(results["ceilings"], results["rows"]))
    if args.breakdown:
        print(breakdown_table(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
