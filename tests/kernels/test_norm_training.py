"""The training RMSNorm kernels (forward and backward, with and without the rotary embedding after the norm)
compute what the model's plain modules compute under mixed precision: float32 master weights, float32 or bf16
activations, the output in the autocast dtype; gradients to the input and the weight equal autograd's on the plain
modules. CPU, Triton interpreter."""
import pytest
import torch

from moe_rl_eks.kernels.norm_training import rms_norm_training
from moe_rl_eks.workloads.model.rotary import apply_rotary, rotary
from moe_rl_eks.workloads.model.transformer import RMSNorm


def norm_module(n):
    module = RMSNorm(n, 1e-6)
    with torch.no_grad():
        module.weight.normal_()
    return module


def relative_error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# bf16 inputs: the plain graph rounds the normalised value's gradient to bf16 where the kernel keeps float32, and
# the interpreter truncates casts to bf16 where compiled kernels round: a few bf16 steps
@pytest.mark.parametrize("x_dtype, out_dtype, tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.float32, torch.bfloat16, 2 ** -7),
                                                     (torch.bfloat16, torch.bfloat16, 2 ** -5)])
def test_rms_norm_forward_and_backward_equal_the_plain_module(x_dtype, out_dtype, tol):
    torch.manual_seed(0)
    module = norm_module(64)
    x = (torch.randn(3, 50, 64) * 3).to(x_dtype)  # 150 rows: more row blocks than programs
    grad = torch.randn(3, 50, 64)
    x_ref = x.clone().requires_grad_()
    want = module(x_ref)
    want.backward(grad.to(want.dtype))
    want_dw, module.weight.grad = module.weight.grad, None
    x_got = x.clone().requires_grad_()
    got = rms_norm_training(x_got, module.weight, 1e-6, out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape
    got.backward(grad.to(out_dtype))
    assert relative_error(got, want.to(out_dtype)) <= tol
    assert x_got.grad.dtype == x_dtype and relative_error(x_got.grad, x_ref.grad) <= tol
    assert module.weight.grad.dtype == torch.float32 and relative_error(module.weight.grad, want_dw) <= tol


@pytest.mark.parametrize("x_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -5)])
def test_norm_then_rope_forward_and_backward_equal_the_plain_modules(x_dtype, tol):
    # q_norm then RoPE as the attention does it, the gradient arriving through the transposed [B, H, S, D] view
    torch.manual_seed(1)
    b, s, heads, dim = 2, 20, 4, 16
    module = norm_module(dim)
    x = torch.randn(b, s, heads, dim).to(x_dtype)
    positions = torch.arange(s).repeat(b, 1) + torch.tensor([[0], [7]])
    cos, sin = rotary(positions, dim, 10000.0, torch.float32)  # [B, 1, S, D]
    grad = torch.randn(b, heads, s, dim)
    x_ref = x.clone().requires_grad_()
    want = apply_rotary(module(x_ref).transpose(1, 2), cos, sin)
    want.backward(grad)
    want_dw, module.weight.grad = module.weight.grad, None
    x_got = x.clone().requires_grad_()
    got = rms_norm_training(x_got, module.weight, 1e-6, x_dtype,
                            rope=(cos[:, 0].reshape(b * s, dim), sin[:, 0].reshape(b * s, dim))).transpose(1, 2)
    got.backward(grad.to(x_dtype))
    assert relative_error(got, want) <= tol
    assert relative_error(x_got.grad, x_ref.grad) <= tol
    assert relative_error(module.weight.grad, want_dw) <= tol


def test_rope_tables_that_do_not_match_the_tokens_are_refused():
    module = norm_module(16)
    x = torch.randn(5, 4, 16)
    cos = torch.ones(4, 16)
    with pytest.raises(ValueError, match="one even row of 16 per token"):
        rms_norm_training(x, module.weight, 1e-6, torch.float32, rope=(cos, cos))
    with pytest.raises(ValueError, match=r"weight \[16\]"):
        rms_norm_training(x, torch.ones(8), 1e-6, torch.float32)
