"""The countdown task behind `make run-gpu`: long, verifiable completions with a long tail, a reward that counts the
steps right before the first slip, warm-up traces that slip at the configured rate, and the run refused when its
lengths or reward cannot fit the task. At a tiny size the whole loop runs on it here, through local-run --quick."""
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.core.rl_config import RewardConfig, TaskConfig
from moe_rl_eks.core.run import load_run
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.tools import local_run
from moe_rl_eks.workloads.rl.data import CountdownTask, Prompt
from moe_rl_eks.workloads.rl.rewards import RewardScorer, countdown_score

GPU_RUN = Path(__file__).parents[2] / "configs" / "runs" / "gpu.yaml"
TASK = load_run(GPU_RUN).rl.task


def test_the_gpu_runs_completions_average_over_256_tokens_and_some_exceed_1024():
    task = CountdownTask(TASK, seed=0)
    lengths = [len(task.problem(i).answer) + 1 for i in range(4000)]  # one token a character, plus end-of-sequence
    assert statistics.fmean(lengths) >= 256 and max(lengths) >= 1024, (statistics.fmean(lengths), max(lengths))
    assert max(lengths) <= TASK.longest_countdown_tokens() <= load_run(GPU_RUN).rl.sampling.max_tokens
    assert task.problem(7) == CountdownTask(TASK, seed=0).problem(7) != CountdownTask(TASK, seed=1).problem(7)


def test_a_problem_is_counted_down_to_its_remainder_each_number_least_significant_digit_first():
    assert TaskConfig.countdown(23, 5) == "81 31 8 3"
    assert TaskConfig.countdown(137, 9).startswith("821 911 011 101 29 38")
    assert TaskConfig.countdown(4, 9) == "4"


@pytest.mark.parametrize("completion, finished, expected", [
    ("81 31 8 3", True, 1.0 + 0.1),  # every step, ended properly
    ("81 31 8 3", False, 1.0),  # cut off: no format reward
    ("81 31 9 4", True, 0.5 + 0.1),  # the third step slipped: two of four before it
    ("81 31 8 3 0", True, 0.8 + 0.1),  # ran on past the remainder: four right of five written
    ("18", True, 0.0 + 0.1),  # the right number in the wrong digit order
    ("81 31 x", True, 0.5),  # not numbers
])
def test_the_reward_counts_the_steps_right_before_the_first_slip(completion, finished, expected):
    prompt = Prompt(0, (1,), "23-5=", "countdown", "81 31 8 3", {})
    assert countdown_score(RewardConfig(function="countdown"), prompt, completion, finished) == pytest.approx(expected)
    scorer = RewardScorer(RewardConfig(function="countdown"))
    assert scorer.score_many([(prompt, completion, finished)])[0].score == pytest.approx(expected)


def test_warm_up_traces_slip_at_the_configured_rate_and_keep_counting():
    task = CountdownTask(TASK, seed=3)
    steps = slips = 0
    for i in range(300):
        a, b = map(int, task.problem(i).prompt[:-1].split("-"))
        values = [a, *(int(x[::-1]) for x in task.well_formed_example(i).split(" "))]
        steps += len(values) - 1
        slips += sum(later != earlier - b for earlier, later in zip(values, values[1:]))
    assert slips / steps == pytest.approx(TASK.trace_error_rate, abs=0.01)


def gpu_run_data() -> dict:
    return yaml.safe_load(GPU_RUN.read_text())


@pytest.mark.parametrize("change, field, fragment", [
    ({"reward": {"function": "arithmetic"}}, "rl.reward.function", "use reward.function: countdown"),
    ({"sampling": {"max_tokens": 1000}}, "rl.sampling.max_tokens", "must be >= 1157"),
])
def test_a_countdown_run_that_cannot_be_scored_fully_is_refused_at_load(tmp_path, change, field, fragment):
    data = gpu_run_data()
    for section, values in change.items():
        data["rl"][section].update(values)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_run(tmp_path / "run.yaml")
    assert field in str(err.value) and fragment in str(err.value), str(err.value)


@pytest.mark.xdist_group("rl_loop")  # the real RL loop's processes: never beside another such run
def test_the_gpu_runs_loop_runs_at_a_tiny_size_on_the_cpu_through_local_run_quick(tmp_path, capsys):
    """configs/runs/gpu.yaml's code path (the countdown task, its warm-up, GRPO, the paired evaluation), shrunk
    to this machine: the CPU, short countdowns, two RL steps in --quick form."""
    data = gpu_run_data()
    data.pop("local_gpus"), data.pop("moe_compute")
    data["model"].update(hidden_size=32, moe_intermediate_size=32, num_hidden_layers=1, head_dim=8, num_experts=4,
                         max_position_embeddings=128, dtype="float32")
    data["parallelism"] = {"ep_backend": "alltoall", "ranks_per_node": 2}
    data["rollout"].update(max_new_tokens=64, max_batch_size=64)
    rl = data["rl"]
    rl["task"].update(min_steps=2, max_steps=8)
    rl["sampling"]["max_tokens"] = 64
    rl["evaluation"]["prompts"] = 32
    rl["training"].update(steps=8, warmup_sft_steps=8, prompts_per_step=4, checkpoint_every=8,
                          max_tokens_per_microbatch=1024, output_dir=str(tmp_path / "out"))
    path = tmp_path / "gpu-tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    assert local_run.main(["--run", str(path), "--quick", "--timeout", "240"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["evaluation"]) == 3
    assert math.isfinite(summary["rl_gain_paired_se"])  # 8 prompts (a quarter of 32), paired
    assert "paired standard errors over 8 prompts" in capsys.readouterr().out


def test_the_gain_is_judged_per_prompt_in_paired_standard_errors():
    gain, se = local_run.paired_gain([0.1, 0.2, 0.3, float("nan")], [0.2, 0.4, 0.3, 0.9])
    assert gain == pytest.approx(0.1) and se == pytest.approx(statistics.stdev([0.1, 0.2, 0.0]) / 3 ** 0.5)
