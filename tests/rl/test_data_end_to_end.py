"""The local real-data example end to end, shortened: word problems in Parquet (verl's layout) made here, a
byte-level BPE tokenizer with a ChatML template, the math-verify reward in worker processes, the whole loop
(two rollout servers, orchestrator, EP=2 trainer), periodic evaluation through a rollout server; the reward on the
evaluation split must rise over the run."""
import json
from pathlib import Path

import yaml

from moe_rl_eks.workloads.rl import local_run
from moe_rl_eks.workloads.rl.evaluation import read_records
from moe_rl_eks.workloads.rl.example_data import write_example

LOCAL_WORDS = Path(__file__).resolve().parents[2] / "configs" / "runs" / "local-words.yaml"


def test_local_run_on_word_problems_through_a_chat_template_raises_the_evaluation_reward(tmp_path, capsys):
    write_example(tmp_path / "data", train=2000, eval_=48, seed=0)
    run = yaml.safe_load(LOCAL_WORDS.read_text())
    rl = run["rl"]
    rl["data"].update(train=str(tmp_path / "data" / "train.parquet"), eval=str(tmp_path / "data" / "eval.parquet"))
    rl["sampling"]["tokenizer"] = str(tmp_path / "data" / "tokenizer")
    rl["evaluation"].update(prompts=48, every_steps=20)
    rl["training"].update(steps=50, warmup_sft_steps=20, checkpoint_every=50, output_dir=str(tmp_path / "out"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    assert local_run.main(["--run", str(path), "--timeout", "420"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    evals = summary["evaluation"]
    assert {"initial", "warmup", "final"} <= set(evals)
    for metrics in evals.values():  # measured on the 48 evaluation problems, 4 samples each, none failed
        assert metrics["eval/prompts"] == 48 and metrics["eval/rewards_failed"] == 0
        assert {"eval/pass@1", "eval/pass@4", "eval/response_tokens_mean", "eval/truncation_rate"} <= set(metrics)
    # Warm-up (another row's answer after each prompt) and RL together raise the reward on the evaluation split.
    # RL alone over the post-warm-up policy is not asserted: this tiny model reaches the answers' prior in 50 steps,
    # not reading the numbers (see the report of this test's numbers in README's support matrix).
    assert evals["final"]["eval/reward_mean"] >= evals["initial"]["eval/reward_mean"] + 0.1, evals
    assert evals["final"]["eval/pass@4"] > evals["initial"]["eval/pass@4"], evals
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and rows[-1]["reward_mean"] > 0
    assert "RL gain over post-warm-up" in capsys.readouterr().out
    periodic = read_records(tmp_path / "out")  # the orchestrator evaluated through a rollout server meanwhile
    assert periodic and all(r["step"] % 20 == 0 and r["eval/prompts"] == 48 for r in periodic), periodic
    assert all(r["eval/weight_version_min"] >= r["step"] for r in periodic)
