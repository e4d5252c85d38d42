"""The decode-step expert kernels (routing + SwiGLU experts + combine in two launches) against plain torch: the
routing of routing.py's kernel and the reference experts, at small shapes that are not multiples of the blocks.
On a CUDA device (pytest without the interpreter) the same tests run compiled, at the same shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_reference as ref
from moe_rl_eks.kernels.expert_decode import decode_experts, supports
from moe_rl_eks.kernels.routing import route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, logits, spec, bias, w13, w2):
    """Per token: sum over its k experts (slot order) of weight * down(silu(gate x) * up x), each expert's output
    rounded to the weights' dtype, the sum in fp32."""
    weights, ids = ref.route(logits, spec, bias)
    width = w2.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(spec.top_k):
            e = ids[t, j]
            h13 = w13[e].float() @ x[t].float()
            act = (F.silu(h13[:width]) * h13[width:]).to(w13.dtype).float()
            out[t] += (w2[e].float() @ act).to(w13.dtype).float() * weights[t, j]
    return out, weights, ids


def case(tokens, experts, hidden, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=gen) / width ** 0.5).to(dtype)
    return (t.to(DEVICE) for t in (x, logits, w13, w2))


@pytest.mark.parametrize("scoring, renormalize, scaling, with_bias", [
    ("softmax", True, 1.0, False),  # Qwen3 (norm_topk_prob)
    ("softmax", False, 1.0, False),
    ("sigmoid", True, 2.5, True),  # DeepSeek-V3's scoring with the selection bias, one group
])
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_experts_route_and_compute_like_the_reference(scoring, renormalize, scaling, with_bias, tokens):
    spec = ref.Spec(top_k=3, scoring=scoring, renormalize=renormalize, scaling=scaling)
    x, logits, w13, w2 = case(tokens, experts=10, hidden=40, width=20, dtype=torch.float32, seed=tokens)
    bias = torch.randn(10, device=DEVICE) * 0.1 if with_bias else None
    out, weights, ids = decode_experts(x, logits, spec, bias, w13, w2)
    want_out, want_w, want_ids = reference(x, logits, spec, bias, w13, w2)
    assert torch.equal(ids.cpu(), want_ids.cpu()) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)


def test_decode_experts_in_bf16_match_the_reference_and_the_training_kernels_routing():
    spec = ref.Spec(top_k=4, scoring="softmax", renormalize=True, scaling=1.0)
    x, logits, w13, w2 = case(tokens=2, experts=12, hidden=48, width=24, dtype=torch.bfloat16, seed=7)
    out, weights, ids = decode_experts(x, logits, spec, None, w13, w2)
    train_w, train_ids = route(logits, spec)
    assert torch.equal(ids, train_ids) and torch.equal(weights, train_w)
    want, _, _ = reference(x, logits, spec, None, w13, w2)
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of each expert's output and of the sum; the interpreter truncates where GPUs round
    assert ((out.float() - want).abs().max() / want.abs().max()).item() < 2 ** -6


def test_a_tokens_output_does_not_depend_on_the_other_tokens_of_the_step():
    spec = ref.Spec(top_k=3, scoring="softmax", renormalize=True, scaling=1.0)
    x, logits, w13, w2 = case(tokens=4, experts=8, hidden=40, width=20, dtype=torch.bfloat16, seed=3)
    together, _, ids = decode_experts(x, logits, spec, None, w13, w2)
    for t in range(4):
        alone, _, ids_alone = decode_experts(x[t:t + 1], logits[t:t + 1], spec, None, w13, w2)
        assert torch.equal(alone[0], together[t]) and torch.equal(ids_alone[0], ids[t])


def test_decode_experts_name_what_they_cannot_route():
    group_limited = ref.Spec(top_k=2, scoring="sigmoid", n_group=2, topk_group=1)
    assert not supports(group_limited, None) and supports(ref.Spec(top_k=2, scoring="softmax"), None)
    x, logits, w13, w2 = case(tokens=1, experts=8, hidden=16, width=8, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="n_group=2"):
        decode_experts(x, logits, group_limited, None, w13, w2)
    with pytest.raises(ValueError, match="do not agree"):
        decode_experts(x, logits[:, :4], ref.Spec(top_k=2, scoring="softmax"), None, w13, w2)
