"""Packed attention's backend per sequence length (model/transformer.py): a sequence of CUDNN_MIN_TOKENS or more
goes to cuDNN's kernel first, a shorter one to flash; on the CPU both paths run torch's CPU kernels. The GPU test
runs on the H200 through the device tool."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_rl_eks.workloads.model.transformer import CUDNN_MIN_TOKENS, packed_attention


def _qkv(lengths, heads, kv_heads, dim, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, h, sum(lengths), dim, generator=g, device=device, dtype=dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def _alone(q, k, v, lengths):
    """Each sequence's causal SDPA on torch's default choice, in the packed output layout [1, S, H, D]."""
    parts = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
    return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True).transpose(1, 2)
                      for a, b, c in parts], 1)


def test_a_long_and_a_short_packed_sequence_attend_each_within_itself_on_the_cpu():
    lengths = [CUDNN_MIN_TOKENS + 5, 37]
    q, k, v = _qkv(lengths, 2, 1, 8, "cpu", torch.float32)
    torch.testing.assert_close(packed_attention(q, k, v, lengths, True), _alone(q, k, v, lengths),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's attention)")
def test_on_a_gpu_a_long_sequence_runs_cudnn_and_a_short_one_flash_with_gradients_as_flash_gives():
    lengths = [CUDNN_MIN_TOKENS, 300]
    q, k, v = _qkv(lengths, 64, 4, 128, "cuda", torch.bfloat16)  # Qwen3-235B-A22B's attention heads
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = packed_attention(q, k, v, lengths, True)
        out.float().square().mean().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_cudnn_attention" in ops and "aten::_scaled_dot_product_flash_attention" in ops
    got = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = _alone(q, k, v, lengths)
        ref.float().square().mean().backward()
    for a, b in zip(got, [ref.detach().float()] + [t.grad.float() for t in (q, k, v)]):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2  # two bf16 kernels' rounding, not a bug's size
