"""The exact numerics mode's scoring before a batch's first update (Trainer._score through TrainStep.score) takes
the exact scorer's logprobs alone: without a critic the policy's fast forward does not run for it, counted by a
forward hook on the trainer's policy, and the step trains bitwise as the scoring through both forwards did (the
values the fast forward carried were the scorer's bits). PPO's critic reads the hidden states of the exact
scorer's differentiable forward, so the fast forward does not run for it either. A tiny model under Triton's
interpreter (the exact kernels on the CPU)."""
from pathlib import Path

import pytest
import torch
import yaml

from moe_rl_eks.core.run import RunConfig
from moe_rl_eks.core.schema import parse
from moe_rl_eks.workloads.rl.protocol import Batch, BatchStats, TrainingSample, VersionRef, one_version
from moe_rl_eks.workloads.trainer import loop
from moe_rl_eks.workloads.trainer.loop import Trainer

LOCAL_RUN = Path(__file__).resolve().parents[2] / "configs" / "runs" / "local.yaml"
TIMINGS = {"step_compute_seconds", "score_seconds", "straggler_ratio"}  # wall-clock: differ run to run


def exact_trainer(tmp_path: Path, algorithm: dict) -> Trainer:
    """configs/runs/local.yaml's model on one trainer rank in the exact mode, its exact scorer loaded with the
    starting weights (what Trainer.publish hands it with version 0)."""
    data = yaml.safe_load(LOCAL_RUN.read_text())
    data.update(numerics="exact", parallelism={"ranks_per_node": 1})
    data["model"]["num_hidden_layers"] = 1  # the interpreter runs every program of every kernel
    data["rl"]["algorithm"].update(kl_coef=0.0, **algorithm)
    data["rl"]["training"]["output_dir"] = str(tmp_path / "out")
    trainer = Trainer(parse(RunConfig, data, source="exact.yaml"), None, rank=0, world=1)
    trainer.train_step.exact.load(trainer.model.state_dict())
    return trainer


def off_policy_batch() -> Batch:
    """Four completions whose behaviour logprobs are not the policy's (every importance weight away from 1)."""
    completions = [([9, 2], 1.0), ([10, 11, 2], -1.0), ([5, 6, 7, 2], 0.5), ([2], -0.5)]
    samples = [TrainingSample(f"p0/{i}", [1, 6, 13, 6, 16], c, [-2.0 - 0.1 * j for j in range(len(c))], a, a, True,
                              one_version(VersionRef(0, 0), len(c))) for i, (c, a) in enumerate(completions)]
    return Batch(0, 0, samples, BatchStats(0.0, 0.5, 0.0, 0, 0, 0, 0, 4))


def count_policy_forwards(trainer: Trainer) -> list[int]:
    """A list that grows by one at every forward of the trainer's policy (not of the exact scorer's copy)."""
    calls: list[int] = []
    trainer.model.register_forward_hook(lambda module, args, output: calls.append(1))
    return calls


def two_forward_scoring(trainer: Trainer):
    """The scoring as it was before the exact scorer's values were taken alone: the fast forward with the exact
    values folded in (numerics.values_with_gradient), for every micro-batch (the scorer's forward made not
    `differentiable`: that one would be the scorer's own)."""
    trainer.train_step.exact.differentiable = False

    def score(mb, *, temperature, replay, values=False):
        fwd = trainer.train_step.forward(trainer.model, mb, temperature=temperature, replay=replay, values=values,
                                         exact_values=True)
        return fwd.logprobs, fwd.values
    return score


def test_exact_scoring_without_a_critic_runs_no_fast_forward_and_trains_bitwise_as_two_forwards(tmp_path,
                                                                                                monkeypatch):
    # two epochs: the batch is scored before its first update (the proximal policy of the second epoch)
    algorithm = {"name": "grpo", "epochs_per_batch": 2}
    trainer, twin = exact_trainer(tmp_path / "a", algorithm), exact_trainer(tmp_path / "b", algorithm)
    monkeypatch.setattr(twin.train_step, "score", two_forward_scoring(twin))
    forwards, twin_forwards = count_policy_forwards(trainer), count_policy_forwards(twin)
    metrics, twin_metrics = trainer.rl_step(off_policy_batch()), twin.rl_step(off_policy_batch())
    # one micro-batch (the batch is far under max_tokens_per_microbatch): one forward per optimizer step
    assert metrics["optimizer_steps"] == 2 and metrics["score_seconds"] > 0
    assert len(forwards) == 2, "the exact mode's scoring ran the policy's fast forward again"
    assert len(twin_forwards) == 3  # the same two, and the scoring's
    assert {k: v for k, v in metrics.items() if k not in TIMINGS} == \
        {k: v for k, v in twin_metrics.items() if k not in TIMINGS}
    assert metrics["importance_weight_mean"] != 1.0 and metrics["loss"] != 0.0  # the batch is off-policy
    for name, param in trainer.model.state_dict().items():  # every weight after two AdamW steps, bit for bit
        assert torch.equal(param.view(torch.int32), twin.model.state_dict()[name].view(torch.int32)), name


@pytest.mark.parametrize("epochs", [1, 2])
def test_exact_scoring_for_ppos_critic_runs_no_fast_forward(tmp_path, epochs):
    trainer = exact_trainer(tmp_path, {"name": "ppo", "group_size": 4, "epochs_per_batch": epochs})
    forwards = count_policy_forwards(trainer)
    metrics = trainer.rl_step(off_policy_batch())
    # the critic's values before any update (its advantages) come from the exact forward's hidden states; each
    # optimizer step's forward is then the fast one (the first takes its values from that scoring)
    assert "critic_explained_variance" in metrics
    assert len(forwards) == metrics["optimizer_steps"] == epochs


def test_a_scored_batchs_first_step_takes_the_scorers_logprobs_from_the_scoring_and_trains_as_a_rescoring(
        tmp_path, monkeypatch):
    # two epochs: scored before the first update, so that step's current logprobs (the published policy's, the
    # scorer's bits) are already in hand; the twin has its first step run the scorer again, as before
    algorithm = {"name": "grpo", "epochs_per_batch": 2}
    trainer, twin = exact_trainer(tmp_path / "a", algorithm), exact_trainer(tmp_path / "b", algorithm)
    scorings = []
    scorer_logprobs = trainer.train_step.exact.logprobs
    monkeypatch.setattr(trainer.train_step.exact, "logprobs", lambda *a, **k: scorings.append(1) or
                        scorer_logprobs(*a, **k))
    metrics = trainer.rl_step(off_policy_batch())
    assert len(scorings) == 1, "the first optimizer step ran the exact scorer again"

    twin_step, twin_steps = twin.train_step.step, []

    def rescoring_step(*args, exact_values, **kwargs):
        first = not twin_steps
        twin_steps.append(1)
        return twin_step(*args, exact_values=exact_values or first, **kwargs)

    monkeypatch.setattr(twin.train_step, "step", rescoring_step)
    twin.train_step.exact.differentiable = False  # as before: the rescoring's gradient from the fast forward
    monkeypatch.setattr(loop, "values_with_gradient", lambda values, differentiable: differentiable)
    twin_metrics = twin.rl_step(off_policy_batch())
    assert {k: v for k, v in metrics.items() if k not in TIMINGS} == \
        {k: v for k, v in twin_metrics.items() if k not in TIMINGS}
    for name, param in trainer.model.state_dict().items():
        assert torch.equal(param.view(torch.int32), twin.model.state_dict()[name].view(torch.int32)), name
