"""The trainer's gradient clipping (trainer/step.clip_to): the bits torch's clip_grads_with_norm_ gives, for
gradients of several dtypes in one call, and none touched when the norm is under the bound."""
import torch

from moe_rl_eks.workloads.trainer.step import clip_to


def _params(g):
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
              ((7, torch.float32), (3, torch.bfloat16), (11, torch.float32))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped
    return params


def test_clipping_scales_every_gradient_as_torch_does_bitwise_and_leaves_a_small_norm_alone():
    for max_norm in (0.5, 1e3):
        ours, torch_ = _params(torch.Generator().manual_seed(0)), _params(torch.Generator().manual_seed(0))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float())
                                                     for p in ours if p.grad is not None]))
        before = [p.grad.clone() for p in ours[:3]]
        clip_to(norm, ours, max_norm)
        torch.nn.utils.clip_grads_with_norm_([p for p in torch_ if p.grad is not None], max_norm, norm)
        for a, b, old in zip(ours[:3], torch_[:3], before):
            assert a.grad.dtype == old.dtype and torch.equal(a.grad, b.grad)
            assert torch.equal(a.grad, old) == (max_norm > norm)
        assert ours[3].grad is None
