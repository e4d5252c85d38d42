"""Tiles for the exact mode's products on one GPU, at Qwen3-30B-A3B's shapes. The dense ones (invariant_matmul.py):
each candidate tile's median milliseconds against cuBLAS at a decode step's rows and a packed forward's, whether it
gives the reference tile's bits (the whole product, bitwise), and the tile invariant_matmul chooses. The experts'
(grouped_gemm.py): the exact tiles and others against the standard mode's tuned kernels ("cublas" there), and
whether the tuned kernels give the exact mode's bits too. A tile that gives the same bits may be chosen by the size
of the batch without a row's bits depending on it; one that does not may not be used at all.

    python3 -m moe_rl_eks.kernels.bench_invariant_tiles --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from .bench import SHAPES
from .bench_exact import HEADS, HEAD_DIM, KV_HEADS, VOCAB
from . import grouped_gemm
from .invariant_matmul import TILES, launch, tile

# the one tile exact mode used for every size before TILES (the bits the others are held to)
REFERENCE = (64, 64, 64, 4, 4)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) beside TILES: narrower columns for more programs at a few rows, wider
# tiles for fewer re-reads at many; BLOCK_M 16 and 32 are below a Hopper warpgroup's 64-row instruction
CANDIDATES = list(dict.fromkeys([*TILES, (64, 16, 64, 4, 4), (64, 32, 64, 4, 4), (16, 32, 64, 4, 4),
                                 (32, 64, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
                                 (128, 128, 64, 8, 4)]))
# At a decode step's few rows only: narrow, deep tiles, more bytes of w in flight per program (a program's K loop is
# the row's whole reduction, without split-K), and 16-row tiles (mma.sync rather than a warpgroup's 64 rows)
FEW_ROWS = 64
FEW_ROW_CANDIDATES = [(16, 16, 256, 4, 4), (16, 16, 512, 4, 3), (16, 32, 256, 4, 4), (16, 32, 512, 4, 3),
                      (32, 16, 256, 4, 4), (64, 16, 256, 4, 3), (64, 32, 256, 4, 3), (16, 16, 256, 2, 6),
                      (16, 64, 256, 4, 3), (16, 16, 128, 4, 6)]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def cases(rows: list[int]):
    hidden = SHAPES["qwen3"].hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in (("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, hidden), ("o_proj", hidden, HEADS * HEAD_DIM),
                       ("router", 128, hidden), ("lm_head", VOCAB, hidden)):
        w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            launch(x, w, want, REFERENCE)
            row = {"case": f"{name} [{n}x{k}]", "rows": m, "cublas_ms": _ms(lambda: F.linear(x, w)),
                   "chosen": str(tile(m, n, 2, x.device))}
            for t in dict.fromkeys([REFERENCE, *CANDIDATES, *(FEW_ROW_CANDIDATES if m <= FEW_ROWS else [])]):
                out = torch.empty_like(want)
                try:
                    launch(x, w, out, t)
                    row[str(t)] = {"ms": _ms(lambda: launch(x, w, out, t)), "same_bits": torch.equal(out, want)}
                except Exception as e:  # a tile over the GPU's shared memory: recorded, not fatal
                    row[str(t)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            yield row


# the experts' GEMMs (gate/up with SwiGLU, then down): the grouped GEMM's tuned tiles and narrower ones
EXPERT_CANDIDATES = list(dict.fromkeys([*grouped_gemm.EXACT_TILES[2], (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                                        (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
                                        (64, 32, 64, 4, 4), (64, 64, 32, 4, 2)]))


def expert_cases(tokens: list[int]):
    shape = SHAPES["qwen3"]
    e, h, width, k = shape.experts, shape.hidden, shape.width, shape.spec.top_k
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = (torch.randn(e, 2 * width, h, generator=g, device="cuda") * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, width, generator=g, device="cuda") * width ** -0.5).to(torch.bfloat16)
    exact = grouped_gemm._gemm_exact[2]
    kernels = {str(t) + (" flat" if f else ""): grouped_gemm._fixed(t, f) for t in EXPERT_CANDIDATES
               for f in ((False, True) if t[0] == 128 and t[3] == 8 else (False,))}

    def run(x, counts, exact_mode=True):
        return grouped_gemm.swiglu_experts(x, counts, w13, w2, exact=exact_mode)

    with torch.no_grad():
        for t in tokens:
            ids = torch.randint(0, e, (t * k,), generator=g, device="cuda").sort().values
            counts = torch.bincount(ids, minlength=e)
            x = torch.randn(t * k, h, generator=g, device="cuda").to(torch.bfloat16)
            want = run(x, counts)
            # "cublas" here: the tuned kernels of the standard mode
            row = {"case": f"experts [{e}x{2 * width}x{h}] top-{k}", "rows": t * k,
                   "cublas_ms": _ms(lambda: run(x, counts, False)),
                   "tuned_same_bits": torch.equal(run(x, counts, False), want),
                   "exact": {"ms": _ms(lambda: run(x, counts)), "same_bits": True}}
            for name, kernel in kernels.items():
                grouped_gemm._gemm_exact[2] = (kernel,)
                try:
                    out = run(x, counts)
                    row[name] = {"ms": _ms(lambda: run(x, counts)), "same_bits": torch.equal(out, want)}
                except Exception as err:  # a tile over the GPU's shared memory: recorded, not fatal
                    row[name] = {"error": f"{type(err).__name__}: {str(err)[:120]}"}
                finally:
                    grouped_gemm._gemm_exact[2] = exact
            yield row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 16384])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256, 2048, 16384])
    p.add_argument("--json", help="write the rows here as well")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "reference tile", REFERENCE)
    print("case rows cublas_ms | tile ms same_bits ...")
    results = []
    for row in itertools.chain(cases(args.rows), expert_cases(args.tokens)):
        results.append(row)
        tiles = {t: v for t, v in row.items() if isinstance(v, dict)}
        cells = [f"{t} {v['ms']:.4f} {'=' if v['same_bits'] else 'DIFF'}" if "ms" in v else f"{t} {v['error']}"
                 for t, v in tiles.items()]
        best = min((v["ms"], t) for t, v in tiles.items() if "ms" in v and v["same_bits"])
        chosen = row.get("chosen", "exact")
        tuned = "" if "tuned_same_bits" not in row else f"tuned bits {'=' if row['tuned_same_bits'] else 'DIFF'} | "
        chosen = f"{tuned}chosen {chosen} {tiles[chosen]['ms'] / row['cublas_ms']:.2f}x cublas | "
        print(f"{row['case']} {row['rows']} cublas {row['cublas_ms']:.4f} {chosen}best-equal {best[1]} {best[0]:.4f} "
              f"({best[0] / row['cublas_ms']:.2f}x cublas) | " + " | ".join(cells), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
