"""The rollout/trainer logprob mismatch the trainer reports every step (trainer/numerics.MismatchTally), against
numbers computed by hand: bitwise equality, |d log p| and the KL between the two policies both ways."""
import math

import pytest
import torch

from moe_rl_eks.workloads.trainer.numerics import MismatchTally


def test_the_mismatch_tally_counts_equal_tokens_differences_and_both_kls_over_the_completion_tokens():
    trainer = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -3.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -1.5], [-0.25, -9.0, 0.0]])  # [1, 1] is padding: not counted
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tally = MismatchTally(torch.device("cpu"))
    tally.add(trainer[:1], rollout[:1], mask[:1])  # micro-batch by micro-batch
    tally.add(trainer[1:], rollout[1:], mask[1:])
    report = tally.metrics(lambda t: t, lambda t: t)
    d = [0.0, 0.5, -0.5, 0.0]  # log p_trainer - log p_rollout on the four completion tokens
    assert report["logprob_bitwise_equal"] == 0.5
    assert report["logprob_abs_diff_mean"] == 0.25 and report["logprob_abs_diff_max"] == 0.5
    # KL(rollout || trainer): k3 = e^d - 1 - d; KL(trainer || rollout): d e^d - e^d + 1, per rollout sample
    assert report["logprob_kl_rollout_trainer"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4, rel=1e-12)
    assert report["logprob_kl_trainer_rollout"] == pytest.approx(sum(x * math.exp(x) - math.exp(x) + 1 for x in d) / 4,
                                                                 rel=1e-12)
    # the two directions differ (0.0638 vs 0.0665 here): the A/B records both
    assert report["logprob_kl_trainer_rollout"] > report["logprob_kl_rollout_trainer"] > 0


def test_an_empty_tally_reports_zeros_not_nan():
    report = MismatchTally(torch.device("cpu")).metrics(lambda t: t, lambda t: t)
    assert report == {"logprob_bitwise_equal": 0.0, "logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0,
                      "logprob_kl_rollout_trainer": 0.0, "logprob_kl_trainer_rollout": 0.0}
