"""The exact mode's expert products: a row's SwiGLU expert output is the same bits whether its expert received it
alone, among 3 rows or among 17, at any position of the expert's rows and beside any other rows; and it is the
float32 computation."""
import pytest
import torch

import moe_reference as ref
from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels import grouped_gemm
from moe_rl_eks.kernels.grouped_gemm import swiglu_experts

from invariance import ROWS, assert_rows_invariant

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest
EXPERTS, HIDDEN, WIDTH = 4, 40, 24  # several K and column tiles, partial ones; 16-byte rows (TMA)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_a_rows_expert_output_does_not_depend_on_how_many_rows_its_expert_received(dtype, tol):
    torch.manual_seed(0)
    pool = torch.randn(2 * ROWS, HIDDEN, device=DEVICE).to(dtype)
    # expert 0 takes most rows (more than one row tile), expert 2 none of the rows under test
    expert = torch.tensor([0] * 9 + [1] * 5 + [3] * 3 + [0, 1, 3, 2] * 4 + [2], device=DEVICE)
    w13 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=DEVICE) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=DEVICE) / WIDTH ** 0.5).to(dtype)

    def run(batch):
        ids = expert[batch]
        order = torch.argsort(ids, stable=True)  # the dispatcher's expert-sorted batch
        y = swiglu_experts(pool[batch][order], torch.bincount(ids, minlength=EXPERTS), w13, w2, exact=True)
        return torch.empty_like(y).index_copy_(0, order, y)

    got = assert_rows_invariant(run)
    order = torch.argsort(expert[:ROWS], stable=True)
    want = ref.experts(pool[:ROWS][order], torch.bincount(expert[:ROWS], minlength=EXPERTS), w13, w2)
    want = torch.empty_like(want).index_copy_(0, order, want)
    assert got.dtype == dtype
    if dtype == torch.float32 and not INTERPRET:
        tol = 5e-3  # compiled, Triton's float32 dot runs on TF32 tensor cores (10-bit mantissa): 2.3e-3 on the H200
    assert ((got.float() - want).norm() / want.norm()).item() < tol


@pytest.mark.skipif(INTERPRET, reason="the tensor cores' property; the interpreter runs one tile")
def test_each_exact_tile_gives_the_experts_the_same_bits_on_the_gpu(monkeypatch):
    # the exact forward picks its tile by the batch's size (grouped_gemm.EXACT_TILES): each must give every row the
    # same bits, at a decode step's few rows per expert and a prefill's many
    torch.manual_seed(4)
    experts, hidden, width = 8, 256, 128
    w13 = (torch.randn(experts, 2 * width, hidden, device=DEVICE) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, width, device=DEVICE) / width ** 0.5).to(torch.bfloat16)
    kernels = grouped_gemm._gemm_exact[2]
    for rows in (24, 1000):
        counts = torch.bincount(torch.randint(0, experts, (rows,), device=DEVICE), minlength=experts)
        x = torch.randn(rows, hidden, device=DEVICE).to(torch.bfloat16)
        outs = []
        for kernel in kernels:
            monkeypatch.setitem(grouped_gemm._gemm_exact, 2, (kernel,))
            outs.append(swiglu_experts(x, counts, w13, w2, exact=True))
        assert len(outs) > 1 and all(torch.equal(o, outs[0]) for o in outs), f"{rows} rows"
