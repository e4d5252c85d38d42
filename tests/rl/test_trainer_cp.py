"""Context parallelism (rl.training.context_parallel; workloads/model/context_parallel.py): a CP group's ranks each
run a slice of a packed micro-batch and attention is made whole by an all-to-all over heads. Gloo ranks on this
CPU against one process on the same batch: the loss and every gradient of the unsplit sequence."""
import os
import random

import pytest
from rl_helpers import tiny_run, write_run
from test_trainer import sample, varied_batch
from test_trainer_fsdp import GRAD_TOLERANCE, relative_error
from trainer_ranks import (ep_step_gradients, ep_step_gradients_from_reference, run_ranks, step_gradients,
                           warm_then_reference)

from moe_rl_eks.workloads.rl.protocol import Batch, BatchStats
from moe_rl_eks.workloads.trainer.loop import Trainer


def long_batch(tokens: int) -> Batch:
    """One sample of `tokens` tokens (a 3-token prompt) beside two short ones: a packed row whose length the CP
    group does not divide, so the padding sequence is exercised too."""
    rng = random.Random(0)
    completion = [rng.randrange(3, 32) for _ in range(tokens - 2)] + [2]
    samples = [sample(0, [1, 6, 13], completion, 1.0, 1.0), sample(1, [1, 7, 13], [5, 6, 2], -1.0),
               sample(2, [1, 8], [9, 9, 2], 0.5)]
    return Batch(0, 0, samples, BatchStats(0.0, 0.5, 0.0, 0, 0, 0, 0, 3))


def compare(tmp_path, world: int, cp: int, batch: Batch, algorithm: str, fsdp: bool = False, grad_tolerance=None,
            kl_coef: float = 0.0):
    """One RL step on `world` ranks in CP groups of `cp` against one process; with `kl_coef` > 0 both score a KL
    reference (trainer_ranks.warm_then_reference), on the ranks laid out as the policy, CP group included."""
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)
    sections = {"algorithm": {"name": algorithm, "kl_coef": kl_coef, "entropy_coef": 0.01},
                "model": {"max_position_embeddings": max(64, tokens)},
                "sampling": {"max_prompt_tokens": 4, "max_tokens": 6},
                "training": {"max_tokens_per_microbatch": max(16384, tokens), "learning_rate": 0.01, "fsdp": fsdp}}
    one = Trainer(tiny_run(tmp_path, **sections), None, rank=0, world=1)
    if kl_coef:
        warm_then_reference(one)
    want_grads, want_metrics = step_gradients(one, batch)
    (tmp_path / "cp").mkdir()
    path = write_run(tmp_path / "cp", **{**sections, "training": {**sections["training"], "context_parallel": cp}})
    ranks_fn = ep_step_gradients_from_reference if kl_coef else ep_step_gradients
    for r in run_ranks(world, ranks_fn, str(path), batch.to_json()):
        assert r["metrics"]["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)
        assert r["metrics"]["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-5)
        assert r["grads"].keys() == want_grads.keys()
        for name, grad in want_grads.items():
            assert relative_error(r["grads"][name], grad) < (grad_tolerance or GRAD_TOLERANCE), name
    return r


@pytest.mark.parametrize("world, cp, algorithm", [(2, 2, "grpo"), (4, 4, "grpo"), (2, 2, "ppo"), (4, 4, "ppo"), (4, 2, "grpo")])
def test_context_parallel_ranks_give_the_loss_and_gradients_of_the_unsplit_batch(tmp_path, world, cp, algorithm):
    # 4 query heads, 2 key/value heads: CP 2 splits both, CP 4 expands the key/value heads per query head; PPO's
    # critic reads the gathered hidden states; (4, 2) is two CP groups of two, each with its own samples
    compare(tmp_path, world, cp, varied_batch(), algorithm)


# 16,384 in the suite (about 15 s here); MOERL_CP_LONG_TOKENS=65536 is the length (225 s on this 2-core
# machine, passed on 2026-12-01: docs/support-matrix.md)
LONG_TOKENS = int(os.environ.get("MOERL_CP_LONG_TOKENS", "16384"))


def test_a_long_sample_trains_over_four_cp_ranks_with_the_unsplit_gradient(tmp_path):
    r = compare(tmp_path, 4, 4, long_batch(LONG_TOKENS), "grpo", fsdp=True)
    assert r["samples"] == ["p0/0", "p1/0", "p2/0"]  # every rank of the group holds every sample


def test_a_kl_reference_under_context_parallelism_shares_the_policys_groups_and_gives_the_unsplit_step(tmp_path):
    compare(tmp_path, 2, 2, varied_batch(), "grpo", kl_coef=0.05)


def test_context_parallel_that_does_not_divide_the_ranks_or_heads_is_refused(tmp_path):
    from moe_rl_eks.core.run import resolve_run
    from moe_rl_eks.core.schema import ConfigError

    run = tiny_run(tmp_path, training={"context_parallel": 3})
    with pytest.raises(ConfigError) as err:
        resolve_run(run, None)
    assert err.value.field == "rl.training.context_parallel" and err.value.value == 3
    assert "must divide the model's 4 query heads" in str(err.value)
    with pytest.raises(ConfigError, match="rl.training.context_parallel: 4 is not allowed; must divide the "
                                          "trainer's 2 ranks"):
        Trainer(tiny_run(tmp_path, training={"context_parallel": 4}), None, rank=0, world=2)
