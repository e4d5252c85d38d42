"""The few-row product of a decode step's projections against torch's matmul, at one row (the multiply-and-sum
path) and several (the padded tl.dot path), with sizes that are not multiples of the blocks."""
import pytest
import torch

from moe_rl_eks.kernels.gemv import MAX_ROWS, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU (pytest --noconftest)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_gemv_equals_the_matmul(rows, dtype, tol):
    torch.manual_seed(rows)
    x = torch.randn(rows, 70, device=DEVICE).to(dtype)
    w = torch.randn(45, 70, device=DEVICE).to(dtype)
    got = gemv(x, w)
    want = x.float() @ w.float().t()
    assert got.shape == (rows, 45) and got.dtype == dtype
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


def test_gemv_keeps_leading_dimensions_and_names_what_it_cannot_take():
    x = torch.randn(2, 1, 32, device=DEVICE)
    w = torch.randn(20, 32, device=DEVICE)
    torch.testing.assert_close(gemv(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        gemv(torch.randn(MAX_ROWS + 1, 32, device=DEVICE), w)


def test_autotuning_skips_reduction_blocks_wider_than_the_reduction():
    from triton import Config

    from moe_rl_eks.kernels._triton import within

    configs = [Config({"B": b, "N": n}) for b, n in ((256, 16), (256, 32), (512, 8), (1024, 4), (2048, 2))]
    assert [c.kwargs["B"] for c in within(configs, "B", 2048)] == [256, 256, 512, 1024, 2048]
    assert [c.kwargs["B"] for c in within(configs, "B", 768)] == [256, 256, 512, 1024]
    assert [c.kwargs["N"] for c in within(configs, "B", 40)] == [16, 32]  # the narrowest, when none fits


def test_several_rows_skip_column_blocks_too_narrow_for_tl_dot_and_one_row_keeps_them():
    from triton import Config

    from moe_rl_eks.kernels.gemv import _prune

    configs = [Config({"BLOCK_N": n, "BLOCK_K": k}) for n, k in ((8, 256), (16, 256), (32, 512), (4, 1024))]
    kept = _prune(configs, {"K": 2048}, BLOCK_M=16)
    assert [c.kwargs["BLOCK_N"] for c in kept] == [16, 32]  # tl.dot needs >= 16 columns
    assert [c.kwargs["BLOCK_N"] for c in _prune(configs, {"K": 2048}, BLOCK_M=1)] == [8, 16, 32, 4]
    assert [c.kwargs["BLOCK_N"] for c in _prune(configs, {"K": 300}, BLOCK_M=1)] == [8, 16, 32]  # BLOCK_K <= ~K
