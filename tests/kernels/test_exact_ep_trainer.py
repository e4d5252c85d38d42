"""The trainer in the exact numerics mode with expert parallelism (2 gloo ranks, each holding half the experts)
against one rank, under Triton's interpreter: each rank's exact scorer, loaded from the version it publishes,
gives its samples the one-rank scorer's logprobs bitwise, and an RL step (a batch of one optimizer step, through the
scorer's differentiable forward, its gradient handed to each rank's policy; under activation checkpointing each
layer's backward the policy's own, recomputed) gives the one rank's loss and gradient norm."""
from pathlib import Path

import pytest
import torch
import yaml

from moe_rl_eks.core.run import RunConfig
from moe_rl_eks.core.schema import parse
from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.workloads.rl.protocol import Batch, BatchStats, TrainingSample, VersionRef, one_version

from exact_ranks import exact_trainer, run_ep_ranks

LOCAL_RUN = Path(__file__).parents[2] / "configs" / "runs" / "local.yaml"


def batch() -> Batch:
    """Five samples of 3 to 9 tokens: the ranks' shares are 3 and 2 samples."""
    prompts = [[1, 6, 13, 6, 16], [2, 7, 3], [4, 4, 9, 1, 5, 8], [3, 11], [5, 6, 7, 8]]
    completions = [[9, 2], [10, 2, 3], [12, 7, 7, 2], [1, 2], [20, 21]]
    samples = [TrainingSample(f"p{i}/0", p, c, [-1.0] * len(c), 1.0 - i % 2, 0.5 - i % 2, True,
                              one_version(VersionRef(0, 0), len(c))) for i, (p, c) in enumerate(zip(prompts, completions))]
    return Batch(0, 0, samples, BatchStats(0.0, 0.5, 0.0, 0, 0, 0, 0, len(samples)))


@pytest.mark.skipif(not INTERPRET, reason="gloo ranks on the CPU, the exact kernels under the interpreter")
@pytest.mark.parametrize("checkpointing", ["off", "full"])
def test_two_expert_parallel_trainer_ranks_score_each_sample_with_the_one_rank_trainers_bits(tmp_path,
                                                                                            checkpointing):
    data = yaml.safe_load(LOCAL_RUN.read_text())
    data["numerics"] = "exact"
    # "full": the step's backward recomputes the policy's layers, their all-to-alls on every rank
    data["rl"]["training"]["activation_checkpointing"] = checkpointing
    data["rl"]["algorithm"]["kl_coef"] = 0.0  # a reference model comes with the warm-up, which this trainer skips
    data["rl"]["training"]["output_dir"] = str(tmp_path / "out")
    run = parse(RunConfig, data, source=str(LOCAL_RUN))
    [one] = run_ep_ranks(1, exact_trainer, run, batch().to_json())
    data["rl"]["training"]["output_dir"] = str(tmp_path / "out-ep2")
    ranks = run_ep_ranks(2, exact_trainer, parse(RunConfig, data, source=str(LOCAL_RUN)), batch().to_json())
    scored = {**ranks[0]["logprobs"], **ranks[1]["logprobs"]}
    assert scored.keys() == one["logprobs"].keys() and ranks[0]["logprobs"] and ranks[1]["logprobs"]
    for sample, logprobs in one["logprobs"].items():
        assert torch.equal(scored[sample], logprobs), sample
    # the step's first forward takes its values from the same scorer: the reported mismatch is the one rank's
    for name in ("loss", "logprob_abs_diff_mean", "logprob_abs_diff_max"):
        assert ranks[0]["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-6), name
    # the gradient summed over the ranks' experts and micro-batches: float32 sums in another order
    assert one["metrics"]["optimizer_steps"] == 1 and one["metrics"]["grad_norm"] > 0
    assert ranks[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
