"""Advantages and losses against values computed by hand (the arithmetic is in each test's comment)."""
import math

import pytest
import torch

from moe_rl_eks.workloads.rl.algorithms import (SequenceScores, gae, grpo_advantages, make_algorithm,
                                                terminal_rewards, varied_groups, whiten)
from moe_rl_eks.core.rl_config import AlgorithmConfig, RLConfig, SamplingConfig
from moe_rl_eks.workloads.rl.losses import (PolicyBatch, Totals, kl_estimate,
                                            value_loss_per_token)


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


def test_gae_of_a_rank_with_no_samples_is_empty():
    adv, ret = gae(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0), gamma=1.0, lam=0.95)
    assert adv.shape == ret.shape == (0, 0)


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
    loss, m = algorithm("grpo", clip_low=0.2, clip_high=0.28, importance_cap=2.0).loss(batch, Totals(2.0, 1.0))
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["importance_truncated_fraction"] == pytest.approx(0.5)
    assert m["importance_weight_mean"] == pytest.approx(2.5, abs=1e-6)
    loss.backward()
    # d/dlogp of -w r A / n = -2 * 1.25 / 2 on token 0; the clipped token 1 has no gradient
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-1.25, 0.0]]))


def test_a_sample_sampled_across_a_weight_swap_is_weighted_per_token_by_the_version_that_sampled_each():
    from moe_rl_eks.workloads.rl.protocol import TrainingSample, VersionSpan
    from moe_rl_eks.workloads.trainer.microbatch import Sequences

    # Three tokens: two sampled with version 3 (probabilities 0.1, 0.4 under it), one with version 4 after an
    # in-flight swap (0.5 under it). The trainer's proximal policy gives them 0.4, 0.4, 0.25.
    sample = TrainingSample("p0/0", [1, 2], [5, 6, 7], [math.log(0.1), math.log(0.4), math.log(0.5)], 1.0, 1.0, True,
                            [VersionSpan(0, 3, 2), VersionSpan(0, 4, 1)])
    seqs = Sequences.of([sample])
    behaviour = seqs.behaviour[seqs.mask.bool()]
    assert torch.allclose(behaviour, torch.log(torch.tensor([0.1, 0.4, 0.5])))  # each token its own version's
    proximal = torch.log(torch.tensor([[0.4, 0.4, 0.25]]))
    batch = PolicyBatch(logprobs=proximal.clone().requires_grad_(), proximal_logprobs=proximal,
                        behaviour_logprobs=behaviour[None], advantages=torch.ones(1, 3), mask=torch.ones(1, 3))
    # w per token = proximal / behaviour: 4, 1, 0.5 (no cap hit at 10); r = 1 -> loss -(4 + 1 + 0.5) / 3
    loss, m = algorithm("grpo", importance_cap=10.0).loss(batch, Totals(3.0, 1.0))
    assert m["importance_weight_mean"] == pytest.approx(5.5 / 3, abs=1e-6)
    assert loss.item() == pytest.approx(-5.5 / 3, abs=1e-6)


def off_policy_batch(b=3, t=5):
    """Rollout logprobs off the trainer's by e^-1 to e^0.9 per token (importance weights 0.41 to 2.72: over the cap
    of 2 on some tokens), a ragged mask, advantages of both signs; the current logprobs a little off the proximal
    ones (some ratios clipped)."""
    g = torch.Generator().manual_seed(0)
    proximal = -torch.rand(b, t, generator=g) - 0.1
    behaviour = proximal + torch.tensor([-1.0, 0.9, -0.3, 0.5, -0.8]).roll(1).repeat(b, 1)
    logprobs = (proximal + torch.empty(b, t).uniform_(-0.4, 0.4, generator=g)).requires_grad_()
    mask = torch.tensor([[1.0] * t, [1.0] * (t - 2) + [0.0] * 2, [1.0] + [0.0] * (t - 1)])
    return PolicyBatch(logprobs, proximal, behaviour, torch.tensor([[1.0], [-1.0], [0.5]]).expand(b, t), mask,
                       entropy=torch.rand(b, t, generator=g))


def loss_and_gradient(batch, name, **cfg):
    loss, metrics = algorithm(name, entropy_coef=0.01, **cfg).loss(batch, Totals(float(batch.mask.sum()), 3.0))
    (gradient,) = torch.autograd.grad(loss, batch.logprobs)
    return loss, gradient, metrics


def bits(t):
    return t.detach().view(torch.int32)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo"])
def test_no_importance_correction_is_the_on_policy_objective_bit_for_bit_on_an_off_policy_batch(name):
    batch = off_policy_batch()
    on_policy = PolicyBatch(batch.logprobs, batch.proximal_logprobs, batch.proximal_logprobs, batch.advantages,
                            batch.mask, entropy=batch.entropy)  # the rollout sampled exactly the trainer's policy
    loss, gradient, metrics = loss_and_gradient(batch, name, importance_correction="none")
    reference, reference_gradient, reference_metrics = loss_and_gradient(on_policy, name)
    assert torch.equal(bits(loss), bits(reference)) and torch.equal(bits(gradient), bits(reference_gradient))
    corrected, corrected_gradient, corrected_metrics = loss_and_gradient(batch, name)
    assert not torch.equal(corrected, loss) and not torch.equal(corrected_gradient, gradient)  # there was a mismatch
    assert metrics["importance_truncated_fraction"] == 0.0
    if name != "gspo":  # a sequence's weight, a geometric mean over its tokens, stays under the cap here
        assert corrected_metrics["importance_truncated_fraction"] > 0
    # the mismatch is still reported (the raw weights, as with the correction on); on policy they are exactly 1
    assert metrics["importance_weight_mean"] == corrected_metrics["importance_weight_mean"] != 1.0
    assert reference_metrics["importance_weight_mean"] == 1.0


def test_truncated_importance_correction_caps_only_from_above_so_a_cap_of_1_still_weighs_tokens_below_1():
    # _two_token_batch: w = 0.4/0.1 = 4 on token 0, 0.4/0.4 = 1 on token 1; with behaviour 0.8 on token 1,
    # w = 0.5 there. Cap 1: token 0 -> 1 * r 1.25 * A 1 = 1.25; token 1 -> 0.5 * min(-0.5, -0.8) = -0.4
    # loss = -(1.25 - 0.4) / 2 = -0.425: the cap does not lift token 1's weight to 1
    batch = _two_token_batch(behaviour_logprobs=torch.log(torch.tensor([[0.1, 0.8]])))
    loss, m = algorithm("grpo", importance_cap=1.0).loss(batch, Totals(2.0, 1.0))
    assert loss.item() == pytest.approx(-0.425, abs=1e-6) and m["importance_truncated_fraction"] == 0.5
    explicit, _ = algorithm("grpo", importance_cap=1.0, importance_correction="truncated").loss(batch, Totals(2.0, 1.0))
    assert torch.equal(bits(explicit), bits(loss))  # truncated is the default
    off, _ = algorithm("grpo", importance_correction="none").loss(batch, Totals(2.0, 1.0))
    assert off.item() == pytest.approx(-(1.25 - 0.8) / 2, abs=1e-6)  # w = 1 on both tokens


def test_bad_importance_settings_are_refused_naming_field_value_and_what_is_allowed(tmp_path):
    from rl_helpers import write_run

    from moe_rl_eks.core.run import load_run
    from moe_rl_eks.core.schema import ConfigError

    with pytest.raises(ConfigError, match=r"rl\.algorithm\.importance_correction: 'off' is not allowed; allowed: "
                                          r"'truncated', 'none'"):
        load_run(write_run(tmp_path, algorithm={"importance_correction": "off"}))
    with pytest.raises(ConfigError, match=r"rl\.algorithm\.importance_cap: 0\.5 is not allowed; must be >= 1: an "
                                          r"on-policy token's weight is 1, .*importance_correction: none turns the "
                                          r"correction off"):
        load_run(write_run(tmp_path, algorithm={"importance_cap": 0.5}))
    run = load_run(write_run(tmp_path, algorithm={"importance_correction": "none"}))
    assert run.rl.algorithm.importance_correction == "none"


def test_clip_higher_is_asymmetric():
    batch = _two_token_batch(mask=torch.tensor([[1.0, 0.0]]))
    # r = 1.25, A = +1, w = 2: symmetric clip 0.2 caps r at 1.2 -> loss -2.4; clip_high 0.28 leaves 1.25 -> -2.5
    symmetric, _ = algorithm("grpo", clip_low=0.2, clip_high=0.2).loss(batch, Totals(1.0, 1.0))
    higher, _ = algorithm("grpo", clip_low=0.2, clip_high=0.28).loss(batch, Totals(1.0, 1.0))
    assert symmetric.item() == pytest.approx(-2.4, abs=1e-6)
    assert higher.item() == pytest.approx(-2.5, abs=1e-6)


def test_token_level_aggregation_divides_by_global_token_count():
    batch = _two_token_batch()
    local, _ = algorithm("grpo").loss(batch, Totals(2.0, 1.0))
    global_, _ = algorithm("grpo").loss(batch, Totals(4.0, 2.0))  # another rank holds 2 more tokens
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
    loss, m = algorithm("grpo", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01).loss(batch, Totals(2.0, 1.0))
    # 0 surrogate + 0.1 * log 2 - 0.01 * mean entropy 2
    assert loss.item() == pytest.approx(0.1 * math.log(2) - 0.02, abs=1e-6)
    assert m["kl"] == pytest.approx(math.log(2)) and m["entropy"] == pytest.approx(2.0)


def test_clipped_value_loss():
    # v = 1.0, v_old = 0.5, R = 2: unclipped (1-2)^2 = 1; clipped v = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69; 0.5 * max
    loss = value_loss_per_token(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), clip=0.2)
    assert loss.item() == pytest.approx(0.845)


def algorithm(name, max_tokens=4, **cfg):
    return make_algorithm(RLConfig(algorithm=AlgorithmConfig(name=name, **cfg),
                                   sampling=SamplingConfig(max_tokens=max_tokens)))


def test_the_algorithm_says_what_the_trainer_must_compute_and_how_often_it_steps():
    grpo = algorithm("grpo", kl_coef=0.1, epochs_per_batch=2, mini_batches=4)
    assert (grpo.name, grpo.needs_values, grpo.needs_reference, grpo.needs_entropy) == ("grpo", False, True, False)
    assert (grpo.epochs, grpo.mini_batches) == (2, 4)
    ppo = algorithm("ppo", entropy_coef=0.01)
    assert (ppo.name, ppo.needs_values, ppo.needs_reference, ppo.needs_entropy) == ("ppo", True, False, True)
    assert torch.equal(ppo.sequence_advantages(torch.tensor([[1.0, 0.0]])), torch.zeros(1, 2))
    assert algorithm("dr_grpo").sequence_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])).tolist() == [[0.5, -0.5, -0.5, 0.5]]
    assert algorithm("gspo").name == "gspo"


def test_dr_grpo_divides_by_the_constant_sequences_times_max_tokens_not_by_tokens():
    # 2 sequences of 1 and 3 valid tokens, max_tokens 4: every token weighs 1 / (2 * 4) = 0.125, whatever the
    # lengths; the token mean would weigh 1 / 4 and the sequence mean 1/2 and 1/6.
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    totals = Totals.of(Totals.local(mask))
    assert (totals.tokens, totals.sequences) == (4.0, 2.0)
    assert torch.equal(algorithm("dr_grpo").normalizer(mask, totals), mask * 0.125)
    assert torch.equal(algorithm("grpo").normalizer(mask, totals), mask * 0.25)
    assert torch.allclose(algorithm("gspo").normalizer(mask, totals),
                          torch.tensor([[0.5, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]))
    # the loss: ratio 1 (current = proximal = behaviour), advantage 1 on every token -> -(sum of weights)
    same = torch.zeros(2, 3)
    batch = PolicyBatch(same, same, same, torch.ones(2, 3), mask)
    assert algorithm("dr_grpo").loss(batch, totals)[0].item() == pytest.approx(-4 * 0.125)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo", "ppo"])
def test_micro_batches_with_the_global_totals_sum_to_the_whole_batch_loss_and_gradient(name):
    torch.manual_seed(0)
    b, t = 6, 5
    mask = (torch.rand(b, t) < 0.7).float()
    mask[:, 0] = 1.0
    logits = torch.randn(b, t, requires_grad=True)
    fields = dict(proximal_logprobs=-torch.rand(b, t), behaviour_logprobs=-torch.rand(b, t),
                  advantages=torch.randn(b, t) * mask)
    algo = algorithm(name, kl_coef=0.1, entropy_coef=0.01)
    extra = lambda rows: dict(reference_logprobs=-torch.ones(b, t)[rows], entropy=torch.ones(b, t)[rows])

    def loss_of(rows, totals):
        logp = torch.nn.functional.logsigmoid(logits[rows])
        pb = PolicyBatch(logp, fields["proximal_logprobs"][rows], fields["behaviour_logprobs"][rows],
                         fields["advantages"][rows], mask[rows], **extra(rows))
        return algo.loss(pb, totals)[0]

    totals = Totals.of(Totals.local(mask))
    whole = loss_of(slice(0, b), totals)
    (g_whole,) = torch.autograd.grad(whole, logits)
    parts = loss_of(slice(0, 2), totals) + loss_of(slice(2, b), totals)
    (g_parts,) = torch.autograd.grad(parts, logits)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(g_parts, g_whole, atol=1e-7)


def test_ppo_advantages_are_whitened_over_the_mask_across_ranks():
    torch.manual_seed(1)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    scores = SequenceScores(rewards=torch.tensor([1.0, 0.0, 0.5]), advantages=torch.zeros(3), mask=mask)
    values = torch.randn(3, 4)
    adv, returns = algorithm("ppo").token_advantages(scores, values)
    valid = adv[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)  # unbiased, as the whitening
    assert torch.equal(adv[~mask.bool()], torch.zeros(3))
    raw, raw_returns = gae(terminal_rewards(scores.rewards, mask), values, mask, gamma=1.0, lam=1.0)  # the default gae_lambda
    assert torch.equal(returns, raw_returns)  # the critic regresses on unwhitened returns
    # two ranks holding rows [0] and [1, 2] whiten with the global statistics through the all-reduce
    rank_sums = []

    def all_reduce(t):  # both ranks' sums, as torch.distributed.all_reduce would leave them
        rank_sums.append(t.clone())
        if len(rank_sums) == 2:
            t.copy_(rank_sums[0] + rank_sums[1])

    whiten(raw[:1], mask[:1], all_reduce)  # rank 0 contributes its sums (a real all-reduce runs both at once)
    both = whiten(raw[1:], mask[1:], all_reduce)
    assert torch.allclose(both, adv[1:], atol=1e-6)


def test_grpo_token_advantages_put_the_sequence_advantage_on_each_completion_token():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv, returns = algorithm("grpo").token_advantages(SequenceScores(torch.zeros(2), torch.tensor([2.0, -1.0]), mask))
    assert torch.equal(adv, torch.tensor([[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]])) and returns is None


@pytest.mark.parametrize("estimator", ["k3", "k3+"])
def test_k3_kl_is_finite_and_bounded_at_extreme_ratios(estimator):
    # unclamped, log p = -20 against log q = -1 gives exp(19) - 1 - 19 = 1.8e8
    logp = torch.tensor([-20.0, -1000.0, -1.0, 0.0], requires_grad=True)
    ref = torch.tensor([-1.0, 0.0, -1000.0, -0.5])
    kl = kl_estimate(logp, ref, estimator)
    assert torch.isfinite(kl).all() and (kl >= 0).all() and (kl <= 10.0).all()
    assert kl[3].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)  # inside the clamps: k3 unchanged
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.isfinite(grad).all() and grad.abs().max() <= 20.0
    if estimator == "k3+":
        # k2's gradient, log p - log q (clamped to +-20): an unbiased KL gradient
        assert grad.tolist() == pytest.approx([-19.0, -20.0, 20.0, 0.5])
    # and the whole loss stays finite and bounded at extreme ratios
    b = torch.tensor([[-30.0, 0.0]], requires_grad=True)
    batch = PolicyBatch(b, torch.tensor([[0.0, -30.0]]), torch.tensor([[-30.0, 0.0]]), torch.tensor([[1.0, -1.0]]),
                        torch.ones(1, 2), reference_logprobs=torch.tensor([[0.0, -40.0]]))
    loss, _ = algorithm("grpo", kl_coef=1.0, kl_estimator=estimator).loss(batch, Totals(2.0, 1.0))
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item()) < 100 and torch.isfinite(b.grad).all()


def test_gspo_uses_one_clipped_ratio_per_sequence():
    # one sequence of 2 tokens: log-ratios log 1.5 and log 0.5 -> sequence ratio exp(mean) = sqrt(0.75) = 0.8660,
    # inside [1 - 0.2, 1 + 0.28]; A = 1, no off-policy weight; sequence mean -> loss = -0.8660
    logp = torch.log(torch.tensor([[0.6, 0.2]])).requires_grad_()
    prox = torch.log(torch.tensor([[0.4, 0.4]]))
    batch = PolicyBatch(logp, prox, prox, torch.ones(1, 2), torch.ones(1, 2))
    loss, m = algorithm("gspo", clip_low=0.2, clip_high=0.28).loss(batch, Totals(2.0, 1.0))
    assert loss.item() == pytest.approx(-math.sqrt(0.75), abs=1e-6) and m["clip_fraction"] == 0.0
    loss.backward()
    # d/dlogp_t of -(1/2) * sum_t s: s / 2 on each token (GSPO-token's form)
    assert logp.grad[0].tolist() == pytest.approx([-math.sqrt(0.75) / 2] * 2, abs=1e-6)
    # a sequence ratio above 1 + clip_high with A > 0 is clipped as a whole: no gradient on any of its tokens
    far = PolicyBatch(torch.log(torch.tensor([[0.8, 0.8]])).requires_grad_(), prox, prox, torch.ones(1, 2),
                      torch.ones(1, 2))
    loss, m = algorithm("gspo", clip_low=0.2, clip_high=0.28).loss(far, Totals(2.0, 1.0))
    loss.backward()
    assert m["clip_fraction"] == 1.0 and torch.equal(far.logprobs.grad, torch.zeros(1, 2))


def test_config_checks_that_every_trainer_rank_gets_samples_in_every_mini_batch(tmp_path):
    from rl_helpers import write_run

    from moe_rl_eks.core.run import load_run, resolve_run
    from moe_rl_eks.core.schema import ConfigError

    # local.yaml: 2 ranks; 1 prompt x 2 completions = 2 samples: one mini-batch fits, two do not
    path = write_run(tmp_path, training={"prompts_per_step": 1}, algorithm={"group_size": 2, "mini_batches": 2})
    with pytest.raises(ConfigError, match=r"rl.training.prompts_per_step: 1 is not allowed; prompts_per_step x rl.algorithm.group_size "
                                          r"\(2\) = 2 samples per step must be >= 2 trainer ranks x "
                                          r"rl.algorithm.mini_batches \(2\)"):
        resolve_run(load_run(path), None)
    resolve_run(load_run(write_run(tmp_path, training={"prompts_per_step": 1}, algorithm={"group_size": 2})), None)
    with pytest.raises(ConfigError, match=r"rl.algorithm.mini_batches: 3 is not allowed; must be <= "):
        load_run(write_run(tmp_path, training={"prompts_per_step": 1}, algorithm={"group_size": 2, "mini_batches": 3}))
    with pytest.raises(ConfigError, match=r"rl.algorithm.name: 'dapo' is not allowed; allowed: 'grpo', 'dr_grpo'"):
        load_run(write_run(tmp_path, algorithm={"name": "dapo"}))


def test_the_ratio_clip_defaults_to_the_token_ranges_and_to_gspos_sequence_ranges():
    assert AlgorithmConfig(name="grpo").ratio_clip() == (0.2, 0.28)
    assert AlgorithmConfig(name="gspo").ratio_clip() == (3e-4, 4e-4)
    assert AlgorithmConfig(name="gspo", clip_high=0.01).ratio_clip() == (3e-4, 0.01)
    # a sequence ratio of 1.001 is past GSPO's 1 + 4e-4: clipped by default
    batch = PolicyBatch(torch.log(torch.tensor([[0.4004, 0.4004]])).requires_grad_(),
                        torch.log(torch.tensor([[0.4, 0.4]])), torch.log(torch.tensor([[0.4, 0.4]])),
                        torch.ones(1, 2), torch.ones(1, 2))
    _, m = algorithm("gspo").loss(batch, Totals(2.0, 1.0))
    assert m["clip_fraction"] == 1.0
    assert AlgorithmConfig().gae_lambda == 1.0
