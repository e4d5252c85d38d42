"""The Triton log-probability kernels (through Triton's interpreter on the CPU) against the torch computation of
the same contract, on float32 and bf16 logits, with a vocabulary that leaves a ragged last block."""
import pytest
import torch

from moe_rl_eks.kernels import logprobs as kernels
from moe_rl_eks.workloads.model import logprobs as reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_stats_and_logit_grads_equal_the_torch_computation(dtype):
    torch.manual_seed(0)
    n, vocab, temperature = 6, 3 * kernels.BLOCK_V - 37, 0.7
    logits = (torch.randn(n, vocab) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,))
    want = reference.softmax_stats(logits, targets, temperature)
    got = kernels.softmax_stats(logits, targets, reference.inverse_temperatures(temperature, n, logits.device))
    for name, g, w in zip(("logp", "entropy", "lse"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    lse, entropy = want[2], want[1]
    g_logp, g_ent = torch.randn(n), torch.randn(n)
    want_grad = reference.logit_grads_(logits.clone(), targets, lse, entropy, g_logp, g_ent, temperature)
    buffer = logits.clone()
    got_grad = kernels.logit_grads_(buffer, targets, lse, entropy, g_logp, g_ent, temperature)
    assert got_grad.data_ptr() == buffer.data_ptr() and got_grad.dtype == dtype  # in place, in the logits' dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=tol, rtol=tol)


def test_the_gradient_kernel_is_the_derivative_of_the_stats():
    # against autograd on the plain formula, so the torch reference itself is checked too
    torch.manual_seed(1)
    n, vocab, temperature = 4, 300, 1.3
    logits = torch.randn(n, vocab, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp, entropy = logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)
    g_logp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    (want,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_ent).sum(), logits)
    stats = kernels.softmax_stats(logits.detach().float(), targets, reference.inverse_temperatures(temperature, n, "cpu"))
    got = kernels.logit_grads_(logits.detach().float(), targets, stats[2], stats[1], g_logp.float(), g_ent.float(),
                               temperature)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_per_row_temperatures_give_each_row_the_bits_of_its_temperature_alone(path):
    # the engine's sampler scores rows of several temperatures in one call, the trainer a batch at one
    torch.manual_seed(3)
    n, vocab = 3, kernels.BLOCK_V + 11
    logits, targets = torch.randn(n, vocab) * 3, torch.randint(0, vocab, (n,))
    temperatures = torch.tensor([0.7, 1.0, 1.3])

    def stats(rows: list[int], temperature) -> torch.Tensor:
        if path == "torch":
            return torch.stack(reference.softmax_stats(logits[rows], targets[rows], temperature))
        inverse = reference.inverse_temperatures(temperature, len(rows), logits.device)
        return torch.stack(kernels.softmax_stats(logits[rows], targets[rows], inverse))

    mixed = stats([0, 1, 2], temperatures)
    for i, t in enumerate(temperatures.tolist()):
        assert torch.equal(mixed[:, i], stats([i], t)[:, 0])
