"""The sampler's Philox kernel draws exactly what the engine's tensor-op Philox (Random123's known answers,
tests/rl/test_generation.py) draws from the same (seed, row, step)."""
import torch

from moe_rl_eks.kernels.philox import row_uniform
from moe_rl_eks.workloads.rollout import sampler


def test_the_philox_kernel_draws_the_engines_uniforms_bitwise():
    big = torch.tensor([0, 2 ** 32 - 1, 5, 2 ** 40 + 3, 2 ** 63 - 1, 123456789])
    key_lo, key_hi, row, step = big & 0xFFFFFFFF, (big >> 7) & 0xFFFFFFFF, big % 1000, big
    want = sampler.row_uniform(key_lo, key_hi, row, step)  # the CPU's numpy path of the same function
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU (pytest --noconftest)
    key_lo, key_hi, row, step = (t.to(device) for t in (key_lo, key_hi, row, step))
    got = row_uniform(key_lo, key_hi, row, step).cpu()
    assert got.dtype == torch.float32 and got.tolist() == want.tolist()
    assert row_uniform(key_lo[:0], key_hi[:0], row[:0], step[:0]).shape == (0,)
