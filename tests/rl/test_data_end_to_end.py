"""The local real-data example end to end, shortened: word problems in Parquet (verl's layout) made here, a
byte-level BPE tokenizer with a ChatML template, the math-verify reward in worker processes, the whole loop
(two rollout servers, orchestrator, EP=2 trainer), periodic evaluation through a rollout server. The warm-up
teaches the answer format only; RL itself must raise the reward on the evaluation split."""
import json
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.tools import local_run
from moe_rl_eks.workloads.orchestrator.evaluation import read_records
from moe_rl_eks.tools.example_data import write_example

# the real RL loop's processes on a 2-core machine: never beside another such run (make test's workers)
pytestmark = pytest.mark.xdist_group("rl_loop")

LOCAL_WORDS = Path(__file__).resolve().parents[2] / "configs" / "runs" / "local-words.yaml"


def test_local_run_on_word_problems_through_a_chat_template_where_rl_raises_the_evaluation_reward(tmp_path, capsys):
    write_example(tmp_path / "data", train=2000, eval_=48, seed=0)
    run = yaml.safe_load(LOCAL_WORDS.read_text())
    rl = run["rl"]
    rl["data"].update(train=str(tmp_path / "data" / "train.parquet"), eval=str(tmp_path / "data" / "eval.parquet"))
    rl["sampling"]["tokenizer"] = str(tmp_path / "data" / "tokenizer")
    rl["evaluation"].update(prompts=48, every_steps=20)
    # Synchronous (each batch sampled by the version before it), so the run repeats; 40 RL steps at a higher rate.
    rl["orchestrator"]["max_staleness"] = 0
    rl["training"].update(steps=40, learning_rate=0.006, checkpoint_every=40, output_dir=str(tmp_path / "out"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    assert local_run.main(["--run", str(path), "--timeout", "420"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    evals = summary["evaluation"]
    assert {"initial", "warmup", "final"} <= set(evals)
    for metrics in evals.values():  # measured on the 48 evaluation problems, 4 samples each, none failed
        assert metrics["eval/prompts"] == 48 and metrics["eval/rewards_failed"] == 0
        assert {"eval/pass@1", "eval/pass@4", "eval/response_tokens_mean", "eval/truncation_rate"} <= set(metrics)
    initial, warmup, final = (evals[k] for k in ("initial", "warmup", "final"))
    # The warm-up (each prompt followed by one of the split's answers drawn uniformly) teaches the format: finished,
    # well-formed answers, worth format_weight 0.1 each, right about as often as a uniform guess.
    assert warmup["eval/truncation_rate"] < 0.1 and warmup["eval/reward_mean"] >= initial["eval/reward_mean"] + 0.08
    # RL alone, from reward: evaluation is seeded (the same weights give the same figures) and 0.1 is three standard
    # errors of a mean over these 192 samples, so weights that did not learn cannot pass. What 40 steps learn is
    # which answers are right most often (README: results of local-words), not yet to read the numbers.
    assert final["eval/reward_mean"] >= warmup["eval/reward_mean"] + 0.1, evals
    assert final["eval/pass@1"] >= warmup["eval/pass@1"] + 0.1, evals
    assert summary["rl_gain"] == final["reward_mean"] - warmup["reward_mean"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and rows[-1]["reward_mean"] > 0
    assert "RL gain over post-warm-up" in capsys.readouterr().out
    periodic = read_records(tmp_path / "out")  # the orchestrator evaluated through a rollout server meanwhile
    assert [r["step"] for r in periodic] == [20, 40] and all(r["eval/prompts"] == 48 for r in periodic), periodic
    assert all(r["eval/weight_version_min"] >= r["step"] for r in periodic)
