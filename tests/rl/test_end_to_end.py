"""`moerl local-run` end to end, shortened: the whole loop (two rollout servers, orchestrator, torchrun trainer
with EP=2 over gloo) on an easier task, seeded; RL must raise the evaluation reward over the post-warm-up policy."""
import json

import pytest
from rl_helpers import write_run

from moe_rl_eks.tools import local_run

# the real RL loop's processes on a 2-core machine: never beside another such run (make test's workers)
pytestmark = pytest.mark.xdist_group("rl_loop")


def test_short_seeded_local_run_raises_the_evaluation_reward(tmp_path, capsys):
    path = write_run(tmp_path, task={"max_operand": 2}, orchestrator={"max_staleness": 0},
                     training={"steps": 80, "warmup_sft_steps": 20, "checkpoint_every": 40, "learning_rate": 0.006})
    assert local_run.main(["--run", str(path), "--timeout", "240"]) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    evals = summary["evaluation"]
    assert evals["warmup"]["reward_mean"] > evals["initial"]["reward_mean"]  # warm-up taught the answer format
    assert summary["rl_gain"] >= 0.05, summary
    assert (out / "reward_curve.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 80
    assert all(row["straggler_ratio"] >= 1.0 for row in rows)  # two EP ranks reported their arrival times
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "LATEST").read_text() == "step-00000080"
    assert "RL gain over post-warm-up" in capsys.readouterr().out
