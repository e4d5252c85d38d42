"""The fused RMSNorm kernel computes what the model's modules compute: the norm, the residual add before it, the
rotary embedding after it."""
import pytest
import torch

from moe_rl_eks.kernels.rmsnorm import rms_norm
from moe_rl_eks.workloads.model.rotary import apply_rotary, rotary
from moe_rl_eks.workloads.model.transformer import RMSNorm

# bf16: one rounding step of the largest outputs (the sum of squares is reduced in another order, and Triton's
# interpreter truncates conversions to bf16 where compiled kernels round to nearest)
TOLERANCES = [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)]


def close(got, want, tol):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= tol


def norm_module(n, dtype):
    module = RMSNorm(n, 1e-6)
    with torch.no_grad():
        module.weight.normal_()
    return module.to(dtype)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 4, 16), (1, 100)])
def test_rms_norm_kernel_equals_the_module(dtype, tol, shape):
    torch.manual_seed(0)
    module = norm_module(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    got = rms_norm(x, module.weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and close(got, module(x), tol)
    delta = torch.randn(shape).to(dtype)
    normed, total = rms_norm(x, module.weight, 1e-6, residual=delta)
    assert close(total, x + delta, tol) and close(normed, module(x + delta), tol)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
def test_rms_norm_with_rope_equals_the_norm_then_the_rotary_embedding(dtype, tol):
    torch.manual_seed(1)
    b, s, heads, dim = 2, 3, 4, 16
    module = norm_module(dim, dtype)
    x = torch.randn(b, s, heads, dim).to(dtype)
    cos, sin = rotary(torch.tensor([[5, 6, 7], [0, 1, 2]]), dim, 10000.0, dtype)  # [B, 1, S, D]
    want = apply_rotary(module(x).transpose(1, 2), cos, sin).transpose(1, 2)
    got = rms_norm(x, module.weight, 1e-6, rope=(cos[:, 0], sin[:, 0]))
    assert close(got, want, tol)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
def test_rms_norm_with_rope_reads_heads_out_of_wider_token_rows_in_place(dtype, tol):
    # the engine's fused q/k/v projection: q is the first `heads` x dim columns of each token's row
    torch.manual_seed(2)
    b, s, heads, dim, extra = 2, 3, 4, 16, 24
    module = norm_module(dim, dtype)
    rows = torch.randn(b, s, heads * dim + extra).to(dtype)
    x = rows[..., :heads * dim].view(b, s, heads, dim)
    assert not x.is_contiguous()
    cos, sin = rotary(torch.tensor([[5, 6, 7], [0, 1, 2]]), dim, 10000.0, dtype)
    got = rms_norm(x, module.weight, 1e-6, rope=(cos[:, 0], sin[:, 0]))
    assert torch.equal(got, rms_norm(x.contiguous(), module.weight, 1e-6, rope=(cos[:, 0], sin[:, 0])))
    assert close(got, apply_rotary(module(x).transpose(1, 2), cos, sin).transpose(1, 2), tol)


def test_queries_and_keys_normalised_in_one_launch_equal_the_attention_modules_path():
    # the engine's decode step: one product over the packed [q; k; v] weights, its q_norm and k_norm
    # weights packed in one [2, D] buffer
    from moe_rl_eks.core.run import ModelConfig
    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.backends import get_forward_kernels
    from moe_rl_eks.workloads.model.paged_forward import PackedAttention, attention_inputs

    torch.manual_seed(3)
    config = ModelConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)
    model = MoETransformer(config).eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_norm.weight.normal_()
        attn.k_norm.weight.normal_()
    x = torch.randn(2, 3, 32)
    cos, sin = rotary(torch.tensor([[5, 6, 7], [0, 1, 2]]), 16, 10000.0, torch.float32)
    q, k, v = attn.project(x)
    table = (cos[:, 0].unsqueeze(-2), sin[:, 0].unsqueeze(-2))
    want = apply_rotary(attn.q_norm(q), *table), apply_rotary(attn.k_norm(k), *table), v
    for kernels in ("torch", "triton"):
        got = attention_inputs(get_forward_kernels(kernels), PackedAttention(model), 0, attn, x, cos[:, 0], sin[:, 0])
        for g, w, heads in zip(got, want, (4, 2, 2)):
            assert g.shape == (2, 3, heads, 16)
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
def test_add_norm_and_the_router_product_in_one_launch_equal_the_separate_ops(dtype, tol):
    from moe_rl_eks.kernels.rmsnorm import add_rms_norm_project

    torch.manual_seed(4)
    module = norm_module(48, dtype)
    h, delta = torch.randn(3, 48).to(dtype), torch.randn(3, 48).to(dtype)
    router = (torch.randn(7, 48) / 7).to(dtype)
    normed, total, logits = add_rms_norm_project(delta, h, module.weight, 1e-6, router)
    want_normed, want_total = rms_norm(delta, module.weight, 1e-6, residual=h)
    assert torch.equal(normed, want_normed) and torch.equal(total, want_total)
    assert logits.shape == (3, 7) and logits.dtype == dtype
    assert close(logits, module(h + delta).float() @ router.float().t(), tol)
