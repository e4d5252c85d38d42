"""The exact mode's product: each row of x @ w.T the same bits alone, among 3 or among 17 rows, at any position
and beside any neighbours, and close to the float32 product."""
import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels.invariant_matmul import TILES, invariant_matmul, launch, tile

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


def test_a_row_alone_and_among_many_rows_gives_the_same_bits_though_the_tile_differs():
    torch.manual_seed(2)
    rows, cols = (40, 40) if INTERPRET else (4096, 400)  # enough for a larger tile than a single row's
    pool = torch.randn(rows, 48, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(cols, 48, device=DEVICE).to(torch.bfloat16)
    assert tile(1, cols, 2, pool.device) != tile(rows, cols, 2, pool.device)
    many = invariant_matmul(pool, w)
    for r in (0, 17, rows - 1):
        assert torch.equal(invariant_matmul(pool[r:r + 1], w)[0], many[r]), f"row {r}"


@pytest.mark.skipif(INTERPRET, reason="the tensor cores' property; the interpreter's dot emulates it")
@pytest.mark.parametrize("m", [1, 100, 300])
def test_every_tile_gives_every_element_the_same_bits_on_the_gpu(m):
    # the property the choice of tile by size rests on (kernels/bench_invariant_tiles.py measured it at the 30B
    # shapes); K = 200 and N = 200 leave partial tiles in every direction
    torch.manual_seed(3)
    x = torch.randn(m, 200, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(200, 200, device=DEVICE) / 200 ** 0.5).to(torch.bfloat16)
    outs = []
    for t in TILES:
        out = torch.empty(m, 200, device=DEVICE, dtype=torch.bfloat16)
        launch(x, w, out, t)
        outs.append(out)
    for t, out in zip(TILES, outs):
        assert torch.equal(out, outs[-1]), f"tile {t} differs from {TILES[-1]}"
