"""The per-row kernels the exact mode shares between the engine and the trainer are batch-invariant as they stand:
RMSNorm (with the residual add, and with q/k norms and the rotary embedding in one launch) and the log-softmax
statistics give a row the same bits alone, among 3 or among 17 rows, at any position, beside any neighbours. Each
row's reduction runs in one program, over blocks whose shape depends on the row's width only."""
import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels.logprobs import softmax_stats
from moe_rl_eks.kernels.rmsnorm import rms_norm
from moe_rl_eks.workloads.model.logprobs import inverse_temperatures
from moe_rl_eks.workloads.model.rotary import apply_rotary, rotary

from invariance import ROWS, assert_rows_invariant

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest
POOL = 2 * ROWS


def hf_norm(x, weight, eps):
    """Hugging Face's order in float64 arithmetic: normalise, round to x's dtype, scale, round."""
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.double() * normed.double()).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2 ** -6), (torch.float32, 1e-6)])
def test_the_residual_add_and_norm_of_a_row_does_not_depend_on_the_batch(dtype, tol):
    torch.manual_seed(0)
    h, delta = (torch.randn(POOL, 48, device=DEVICE).to(dtype) for _ in range(2))  # 48: a masked block tail
    weight = torch.randn(48, device=DEVICE).to(dtype)
    got = assert_rows_invariant(lambda b: torch.stack(rms_norm(delta[b], weight, 1e-6, residual=h[b]), 1))
    # (Triton's interpreter truncates to bf16 where compiled kernels round to nearest: one rounding step apart)
    total = h[:ROWS].double() + delta[:ROWS].double()
    for got_part, want in ((got[:, 1], total), (got[:, 0], hf_norm(total.to(dtype), weight, 1e-6))):
        assert ((got_part.double() - want.double()).abs().max() / want.double().abs().max()).item() <= tol


def test_queries_and_keys_normed_and_rotated_in_one_launch_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    heads, kv_heads, dim = 4, 2, 32
    qk = torch.randn(POOL, heads + kv_heads, dim, device=DEVICE).to(torch.bfloat16)
    weights = torch.randn(2, dim, device=DEVICE).to(torch.bfloat16)
    cos, sin = (t[0, 0] for t in rotary(torch.arange(POOL, device=DEVICE)[None] * 7, dim, 1e6, torch.bfloat16))
    got = assert_rows_invariant(lambda b: rms_norm(qk[b], weights, 1e-6, rope=(cos[b], sin[b]),
                                                   second_weight_from=heads))
    want = torch.cat([apply_rotary(hf_norm(qk[:ROWS, :heads], weights[0], 1e-6), cos[:ROWS, None], sin[:ROWS, None]),
                      apply_rotary(hf_norm(qk[:ROWS, heads:], weights[1], 1e-6), cos[:ROWS, None],
                               sin[:ROWS, None])], 1)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 2 ** -5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_log_softmax_statistics_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(2)
    vocab = 1000  # several vocabulary blocks and a partial one
    logits = (3 * torch.randn(POOL, vocab, device=DEVICE)).to(dtype)
    targets = torch.randint(0, vocab, (POOL,), device=DEVICE)
    got = assert_rows_invariant(lambda b: torch.stack(softmax_stats(logits[b], targets[b], inverse_temperatures(0.7, len(b), DEVICE)), 1))
    z = logits[:ROWS].double() / 0.7
    logp = z.log_softmax(-1)
    want = torch.stack([logp.gather(1, targets[:ROWS, None])[:, 0], -(logp.exp() * logp).sum(-1),
                        z.logsumexp(-1)], 1)
    assert (got.double() - want).abs().max().item() < 1e-4
