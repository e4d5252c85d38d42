"""The chunked lm_head + log-softmax + gather + entropy against the plain computation on full logits, forward
and backward, in float32 and under bf16 autocast; and what it keeps for the backward."""
import math

import pytest
import torch

from moe_rl_eks.workloads.model.logprobs import token_logprobs_and_entropy


def plain(hidden, weight, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def both(hidden, weight, targets, temperature, chunk, autocast, device="cpu"):
    """(values, grads) of the chunked and the plain computation under the same upstream gradients."""
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    g_logp, g_ent = torch.randn(targets.shape, device=device), torch.randn(targets.shape, device=device)
    results = []
    for fn in (lambda h, w: token_logprobs_and_entropy(h, w, targets, temperature=temperature, chunk_tokens=chunk),
               lambda h, w: plain(h, w, targets, temperature)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logp, ent = fn(h, w)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        results.append((logp.detach(), ent.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_plain_computation_in_float32(temperature):
    hidden, weight = torch.randn(3, 7, 16), torch.randn(50, 16) * 0.5
    targets = torch.randint(0, 50, (3, 7))
    got, want = both(hidden, weight, targets, temperature, chunk=5, autocast=False)  # 21 tokens: a ragged last chunk
    for name, g, w in zip(("logp", "entropy", "grad hidden", "grad weight"), got, want):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_logprobs_under_bf16_autocast_match_the_plain_bf16_lm_head(device):
    # Both compute the product in bf16 and the softmax in float32; they differ by bf16 rounding of the weight
    # gradient's per-chunk partial sums and of the products' accumulation order. On CUDA the chunked path runs
    # the Triton kernels (kernels/logprobs.py), so this is their check on the GPU too.
    hidden, weight = torch.randn(2, 40, 32), torch.randn(5000, 32) * 0.3  # more than one kernel block of vocabulary
    targets = torch.randint(0, 5000, (2, 40))
    got, want = both(hidden, weight, targets, 0.8, chunk=16, autocast=True, device=device)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)
    for g, w in zip(got[2:], want[2:]):
        assert g.dtype == w.dtype == torch.float32  # float32 master weights get float32 gradients
        assert float((g - w).norm() / w.norm()) < 1e-2


def test_the_backward_keeps_no_vocabulary_sized_tensor():
    tokens, vocab, h = 64, 512, 8
    hidden = torch.randn(tokens, h, requires_grad=True)
    weight = torch.randn(vocab, h, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = token_logprobs_and_entropy(hidden, weight, torch.randint(0, vocab, (tokens,)), chunk_tokens=16)
    # the inputs (hidden, weight, targets) and two numbers per token (log-sum-exp, entropy); nothing of size
    # tokens x vocabulary
    assert sum(saved) == tokens * h + vocab * h + 3 * tokens
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_bad_arguments_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="temperature must be > 0, not 0"):
        token_logprobs_and_entropy(torch.randn(2, 4), torch.randn(8, 4), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"hidden \(2, 4\) and targets \(3,\) disagree"):
        token_logprobs_and_entropy(torch.randn(2, 4), torch.randn(8, 4), torch.zeros(3, dtype=torch.long))


def test_uniform_logits_give_every_token_log_v_and_the_entropy_log_v():
    logp, ent = token_logprobs_and_entropy(torch.randn(2, 3), torch.zeros(4, 3), torch.tensor([0, 3]))
    assert torch.allclose(logp, torch.full((2,), -math.log(4))) and torch.allclose(ent, torch.full((2,), math.log(4)))
