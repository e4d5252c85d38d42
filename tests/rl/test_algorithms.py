"""Advantages and losses against values computed by hand (the arithmetic is in each test's comment)."""
import math

import pytest
import torch

from moe_rl_eks.workloads.rl.algorithms import (gae, grpo_advantages, terminal_rewards, varied_groups,
                                                within_staleness)
from moe_rl_eks.core.rl_config import AlgorithmConfig
from moe_rl_eks.workloads.rl.losses import (PolicyBatch, kl_estimate, policy_loss, token_logprobs_and_entropy,
                                            value_loss)


def test_grpo_scales_by_unbiased_group_std_and_dr_grpo_only_centres():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    adv = grpo_advantages(rewards, scale_by_std=True)
    assert torch.allclose(adv[0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # a constant group has no signal, and no division by zero
    dr = grpo_advantages(rewards, scale_by_std=False)
    assert torch.equal(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_dynamic_sampling_keeps_only_groups_whose_rewards_vary():
    assert varied_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])).tolist() == [False, True, False]


def test_gae_matches_hand_computation_and_ignores_padding():
    # gamma 1, lambda 0.5: t=1 delta = 1 - 0.8 = 0.2 -> A1 = 0.2; t=0 delta = 0.8 - 0.5 = 0.3 -> A0 = 0.3 + 0.5 * 0.2
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.8, 9.0]])  # position 2 is padding: its value must not bootstrap into t=1
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.4, 0.2, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.9, 1.0, 0.0]]))


def test_terminal_rewards_sit_on_the_last_completion_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(terminal_rewards(torch.tensor([2.0, 3.0]), mask), torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))


def _two_token_batch(**overrides):
    fields = dict(
        logprobs=torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_(),
        proximal_logprobs=torch.log(torch.tensor([[0.4, 0.4]])),
        behaviour_logprobs=torch.log(torch.tensor([[0.1, 0.4]])),
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.tensor([[1.0, 1.0]]))
    fields.update(overrides)
    return PolicyBatch(**fields)


def test_decoupled_ppo_loss_with_truncated_importance_weight_and_clip():
    # token 0: r = 0.5/0.4 = 1.25 (inside [0.8, 1.28]), A = +1, w = 0.4/0.1 = 4 truncated to 2 -> 2 * 1.25 = 2.5
    # token 1: r = 0.2/0.4 = 0.5, A = -1: min(-0.5, 0.8 * -1) = -0.8 (clipped), w = 1 -> -0.8
    # loss = -(2.5 - 0.8) / 2 tokens = -0.85
    batch = _two_token_batch()
    loss, m = policy_loss(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.28, importance_cap=2.0))
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["importance_truncated_fraction"] == pytest.approx(0.5)
    assert m["importance_weight_mean"] == pytest.approx(2.5, abs=1e-6)
    loss.backward()
    # d/dlogp of -w r A / n = -2 * 1.25 / 2 on token 0; the clipped token 1 has no gradient
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-1.25, 0.0]]))


def test_clip_higher_is_asymmetric():
    batch = _two_token_batch(mask=torch.tensor([[1.0, 0.0]]))
    # r = 1.25, A = +1, w = 2: symmetric clip 0.2 caps r at 1.2 -> loss -2.4; clip_high 0.28 leaves 1.25 -> -2.5
    symmetric, _ = policy_loss(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.2))
    higher, _ = policy_loss(batch, AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    assert symmetric.item() == pytest.approx(-2.4, abs=1e-6)
    assert higher.item() == pytest.approx(-2.5, abs=1e-6)


def test_token_level_aggregation_divides_by_global_token_count():
    batch = _two_token_batch()
    local, _ = policy_loss(batch, AlgorithmConfig())
    global_, _ = policy_loss(batch, AlgorithmConfig(), num_tokens=4)  # another rank holds 2 more tokens
    assert global_.item() == pytest.approx(local.item() / 2)


def test_kl_estimators_k1_and_k3():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))  # log 0.5 - log 0.25
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))  # q/p - 1 - log(q/p)
    with pytest.raises(ValueError, match="k2"):
        kl_estimate(logp, ref, "k2")


def test_kl_penalty_and_entropy_bonus_enter_the_loss():
    same = torch.log(torch.tensor([[0.5, 0.5]]))
    batch = PolicyBatch(logprobs=same, proximal_logprobs=same, behaviour_logprobs=same,
                        advantages=torch.zeros(1, 2), mask=torch.ones(1, 2),
                        reference_logprobs=torch.log(torch.tensor([[0.25, 0.25]])),
                        entropy=torch.tensor([[1.0, 3.0]]))
    loss, m = policy_loss(batch, AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01))
    # 0 surrogate + 0.1 * log 2 - 0.01 * mean entropy 2
    assert loss.item() == pytest.approx(0.1 * math.log(2) - 0.02, abs=1e-6)
    assert m["kl"] == pytest.approx(math.log(2)) and m["entropy"] == pytest.approx(2.0)


def test_clipped_value_loss():
    # v = 1.0, v_old = 0.5, R = 2: unclipped (1-2)^2 = 1; clipped v = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69; 0.5 * max
    loss = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.845)


def test_staleness_bound():
    assert within_staleness(5, 5, 0) and not within_staleness(5, 4, 0)
    assert within_staleness(5, 4, 1) and not within_staleness(5, 3, 1)


def test_token_logprobs_and_entropy_of_uniform_logits():
    logp, ent = token_logprobs_and_entropy(torch.zeros(1, 2, 4), torch.tensor([[0, 3]]))
    assert torch.allclose(logp, torch.full((1, 2), -math.log(4)))
    assert torch.allclose(ent, torch.full((1, 2), math.log(4)))
