"""The `torch` backend's grouped-GEMM path (torch._grouped_mm, bf16 CUDA) against its float32 per-expert loop,
forward and backward, with empty experts. Skipped without CUDA."""
import pytest
import torch

from moe_rl_eks.workloads.moe.torch_compute import TorchCompute

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_grouped_mm_experts_match_the_float32_loop_forward_and_backward():
    compute = TorchCompute()
    torch.manual_seed(0)
    counts = torch.tensor([37, 0, 5, 0, 90, 1, 0, 27])
    n, h, width = int(counts.sum()), 256, 64
    x = torch.randn(n, h)
    w13, w2 = torch.randn(8, 2 * width, h) / 16, torch.randn(8, h, width) / 8
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    want = compute.experts(*leaves[:1], counts, *leaves[1:])
    want.square().sum().backward()
    gpu = [t.to("cuda", torch.bfloat16).requires_grad_() for t in (x, w13, w2)]
    got = compute.experts(gpu[0], counts.cuda(), gpu[1], gpu[2])
    got.float().square().sum().backward()
    for name, g, w in [("out", got, want)] + [(f"grad{i}", a.grad, b.grad) for i, (a, b) in enumerate(zip(gpu, leaves))]:
        err = (g.float().cpu() - w).abs().max() / w.abs().max()
        assert err < 2e-2, f"{name}: relative error {err:.3g}"
