"""The exact mode's product: each row of x @ w.T the same bits alone, among 3 or among 17 rows, at any position
and beside any neighbours, and close to the float32 product."""
import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels.invariant_matmul import invariant_matmul

from invariance import ROWS, assert_rows_invariant

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)])
def test_a_rows_product_does_not_depend_on_the_batch_and_equals_the_float32_product(dtype, tol):
    torch.manual_seed(0)
    # K = 70 and N = 45: partial reduction and column tiles; 2 * ROWS pool rows: partial row tiles too
    pool = torch.randn(2 * ROWS, 70, device=DEVICE).to(dtype)
    w = torch.randn(45, 70, device=DEVICE).to(dtype)
    got = assert_rows_invariant(lambda batch: invariant_matmul(pool[batch], w))
    want = pool[:ROWS].double() @ w.double().t()
    assert got.dtype == dtype and got.shape == (ROWS, 45)
    assert ((got.double() - want).abs() / want.abs().clamp(min=1)).max().item() < tol


def test_leading_dimensions_and_strided_rows_give_the_same_bits_and_bad_operands_are_named():
    torch.manual_seed(1)
    x = torch.randn(4, 2, 40, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(24, 40, device=DEVICE).to(torch.bfloat16)
    flat = invariant_matmul(x.reshape(8, 40), w)
    assert torch.equal(invariant_matmul(x, w), flat.view(4, 2, 24))
    wide = torch.cat([x, x], -1)[..., :40]  # rows 80 apart
    assert torch.equal(invariant_matmul(wide, w), flat.view(4, 2, 24))
    with pytest.raises(ValueError, match=r"w \[N, K=40\] of one dtype"):
        invariant_matmul(x, w.float())
