"""`moerl bench-ppo` (tools/bench/ppo.py): its summary's arithmetic, and the whole bench at a tiny size."""
import json
import math
import statistics

import pytest
import yaml
from rl_helpers import REPO

from moe_rl_eks.tools.bench import ppo


def test_the_summary_compares_the_second_halves_per_seed_with_the_standard_error_over_seeds():
    rewards = {"grpo": {0: [0.0, 0.0, 0.5, 0.7], 1: [0.0, 0.0, 0.4, 0.4]},
               "ppo": {0: [0.0, 0.0, 0.6, 0.8], 1: [1.0, 1.0, 0.3, 0.4]}}  # the first halves do not count
    s = ppo.summarize(rewards)
    assert s["window"] == [3, 4] and s["steps"] == 4
    assert [r["ppo_minus_grpo"] for r in s["per_seed"]] == pytest.approx([0.1, -0.05])
    assert s["ppo_minus_grpo"] == pytest.approx(0.025)
    assert s["ppo_minus_grpo_se"] == pytest.approx(statistics.stdev([0.1, -0.05]) / math.sqrt(2))
    assert (s["ppo_ahead_seeds"], s["seeds"]) == (1, 2)
    assert "PPO - GRPO over steps 3-4: +0.0250 +- 0.0750 (standard error over 2 seeds); PPO ahead on 1 of 2." \
        in ppo.table(s)


def test_the_bench_runs_both_arms_and_writes_its_table_and_json_at_a_tiny_size(tmp_path, capsys):
    data = yaml.safe_load(ppo.RUN.read_text())
    data["rl"]["training"].update(warmup_sft_steps=4, prompts_per_step=2)
    run = tmp_path / "tiny.yaml"
    run.write_text(yaml.safe_dump(data))
    argv = ["--run", str(run), "--steps", "2", "--seeds", "3", "--out", str(tmp_path / "out"),
            "--results", str(tmp_path / "cpu-bench-ppo")]
    assert ppo.main(argv) == 0
    result = json.loads((tmp_path / "cpu-bench-ppo.json").read_text())
    assert result["command"] == "moerl bench-ppo " + " ".join(argv) and result["machine"].startswith("CPU")
    assert result["arms"]["ppo"]["critic_epochs"] == 4 and result["window"] == [2, 2]
    (row,) = result["per_seed"]
    for arm in ("grpo", "ppo"):
        assert len(result["rewards"][arm]["3"]) == 2 and row[arm] == result["rewards"][arm]["3"][1]
        assert 0 <= row[arm] <= 1
    assert row["ppo_minus_grpo"] == pytest.approx(row["ppo"] - row["grpo"]) == result["ppo_minus_grpo"]
    assert math.isnan(result["ppo_minus_grpo_se"])  # one seed: no spread to measure
    markdown = (tmp_path / "cpu-bench-ppo.md").read_text()
    assert "CPU" in markdown and result["command"] in markdown
    assert f"| 3 | {row['grpo']:.3f} | {row['ppo']:.3f} |" in capsys.readouterr().out
    # PPO's critic took its fitting epochs: the trainer's own metrics say so
    rows = [json.loads(line) for line in (tmp_path / "out" / "ppo-seed3" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["critic_fit_value_loss"]) for r in rows)


def test_the_bench_refuses_a_run_too_short_to_have_a_second_half(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ppo.main(["--steps", "1", "--out", str(tmp_path)])
    assert "--steps 1: must be >= 2" in capsys.readouterr().err
