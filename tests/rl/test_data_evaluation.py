"""Evaluation: the unbiased pass@k estimator, metrics from scored samples (failed rewards masked), sampling from
a model in process and from a rollout server over HTTP, records for TensorBoard, and `moerl eval --model DIR`."""
import json
import math
import shutil

import pytest
import torch

from moe_rl_eks.core.rl_config import RewardConfig
from moe_rl_eks.workloads.rl.data import Prompt
from moe_rl_eks.tools.evaluate import model_completer
from moe_rl_eks.workloads.orchestrator.evaluation import (EvalParams, PeriodicEvaluator, EvalSample, ScalarWriter, evaluate,
                                                          http_completer, pass_at_k, read_records, record)
from moe_rl_eks.workloads.rl.rewards import RewardScorer
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError, match="n=2, c=0, k=3"):
        pass_at_k(2, 0, 3)


def scripted(answers: dict[int, list[tuple[str, bool]]]):
    """A completer that returns fixed completions per prompt index (the policy is not what is under test)."""
    def complete(prompts, params):
        return [[EvalSample(text, len(text) + finished, finished) for text, finished in answers[p.index]] for p in prompts]
    return complete


def test_metrics_from_scored_samples_mask_failed_rewards(tmp_path, monkeypatch):
    (tmp_path / "flaky.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == 'x':\n        raise ValueError('cannot score')\n"
        "    return float(solution_str == ground_truth)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = [Prompt(0, (1,), "1+1=", "a", "2", {}), Prompt(1, (1,), "2+2=", "a", "4", {}),
               Prompt(2, (1,), "3+3=", "b", "6", {})]
    complete = scripted({0: [("2", True), ("3", True), ("2", False), ("x", True)],
                         1: [("5", True), ("5", True), ("5", True), ("5", False)],
                         2: [("6", True), ("6", True), ("6", True), ("6", True)]})
    scorer = RewardScorer(RewardConfig(function="flaky:score", workers=1))
    try:
        m = evaluate(prompts, complete, scorer, EvalParams(4, 8, 1.0, 1.0, 0), pass_threshold=1.0)
    finally:
        scorer.close()
    # prompt 0: 3 scored samples, 2 correct; prompt 1: 0 of 4; prompt 2: 4 of 4
    assert m["eval/reward_mean"] == pytest.approx(6 / 11)
    assert m["eval/pass@1"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert m["eval/pass@4"] == pytest.approx((0 + 1) / 2)  # prompt 0 has < 4 scored samples: left out
    assert m["eval/truncation_rate"] == pytest.approx(2 / 12)
    assert m["eval/response_tokens_mean"] == pytest.approx(sum([2, 2, 1, 2, 2, 2, 2, 1, 2, 2, 2, 2]) / 12)
    assert m["eval/rewards_failed"] == 1.0 and m["eval/prompts"] == 3.0
    assert m["eval/b/pass@1"] == 1.0 and m["eval/a/prompts"] == 2.0


def test_records_go_to_eval_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = ScalarWriter(tmp_path / "tb")  # torch-free: the orchestrator writes it
    record(tmp_path, 5, {"eval/reward_mean": 0.5, "eval/pass@4": 0.75}, writer)
    record(tmp_path, 10, {"eval/reward_mean": 0.7, "eval/pass@4": 0.8}, writer)
    writer.close()
    assert [r["step"] for r in read_records(tmp_path)] == [5, 10]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/pass@4")] == [(5, 0.75), (10, 0.8)]


def tiny_model(vocab_size: int, seed: int = 0):
    from moe_rl_eks.core.run import ModelConfig
    from moe_rl_eks.workloads.model import MoETransformer

    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256, dtype="float32")
    return MoETransformer(config).eval()


def test_model_completer_samples_n_seeded_completions_per_prompt():
    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size)
    prompts = [Prompt(i, tuple(tok.encode(f"{i}+1=")), f"{i}+1=", "arithmetic", str(i + 1), {}) for i in range(3)]
    complete = model_completer(model, tok)
    params = EvalParams(n=4, max_tokens=3, temperature=1.0, top_p=1.0, seed=7)
    first, again = complete(prompts, params), complete(prompts, params)
    assert first == again and [len(g) for g in first] == [4, 4, 4]
    assert all(1 <= s.tokens <= 3 and (s.finished or s.tokens == 3) for g in first for s in g)
    assert complete(prompts, EvalParams(4, 3, 1.0, 1.0, seed=8)) != first


def test_http_completer_samples_from_a_rollout_server(rollout):
    tok = CharTokenizer()
    prompts = [Prompt(i, tuple(tok.encode(f"{i}+2=")), f"{i}+2=", "arithmetic", str(i + 2), {}) for i in range(3)]
    complete = http_completer(rollout["url"], tok, model=rollout["run"].name, concurrency=2)
    params = EvalParams(n=3, max_tokens=2, temperature=1.0, top_p=1.0, seed=1)
    samples = complete(prompts, params)
    assert [len(g) for g in samples] == [3, 3, 3] and samples == complete(prompts, params)  # seeded
    for group in samples:
        for s in group:
            # one character per token, minus the stop token of a finished row (and any <bos> the model sampled)
            assert 1 <= s.tokens <= 2 and len(s.text) <= s.tokens - s.finished
    scorer = RewardScorer(RewardConfig())
    metrics = evaluate(prompts, complete, scorer, params, pass_threshold=1.0)
    assert metrics["eval/prompts"] == 3.0 and metrics["eval/rewards_failed"] == 0.0


def test_periodic_evaluation_runs_when_due_against_a_server_and_records_it(rollout, tmp_path):
    import dataclasses

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = rollout["run"]
    run = dataclasses.replace(run, rl=dataclasses.replace(run.rl, evaluation=dataclasses.replace(
        run.rl.evaluation, every_steps=5, prompts=4, samples_per_prompt=2, max_tokens=2)))
    evaluator = PeriodicEvaluator(run, tmp_path / "out", CharTokenizer())
    try:
        assert not evaluator.maybe_start(0, rollout["url"]) and not evaluator.maybe_start(3, rollout["url"])
        assert evaluator.maybe_start(5, rollout["url"])
        evaluator.wait(120)
    finally:
        evaluator.close()
    (rec,) = read_records(tmp_path / "out")
    assert rec["step"] == 5 and rec["eval/prompts"] == 4.0 and "eval/pass@2" in rec
    assert rec["eval/weight_version_min"] == rec["eval/weight_version_max"] == 0.0  # what the server sampled with
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [5]


def test_moerl_eval_scores_a_checkpoint_on_a_dataset(tmp_path, capsys):
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.tools.evaluate import main
    from moe_rl_eks.tools.example_data import write_example
    from moe_rl_eks.workloads.rl.tokenizer import load_model_tokenizer

    write_example(tmp_path / "data", train=8, eval_=6)
    tok = load_model_tokenizer(tmp_path / "data" / "tokenizer")
    model = tiny_model(tok.vocab_size)
    save_hf(model, model.config, tmp_path / "ckpt")
    for f in (tmp_path / "data" / "tokenizer").iterdir():
        shutil.copy(f, tmp_path / "ckpt" / f.name)
    rc = main(["--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data" / "eval.parquet"),
               "--prompts", "5", "-n", "2", "--max-tokens", "4", "--chat-template-kwargs",
               '{"enable_thinking": false}', "--out", str(tmp_path / "out")])
    metrics = json.loads(capsys.readouterr().out)
    assert rc == 0 and metrics["eval/prompts"] == 5.0 and "eval/pass@2" in metrics
    assert 0 <= metrics["eval/reward_mean"] <= 1.1 and 1 <= metrics["eval/response_tokens_mean"] <= 4
    assert read_records(tmp_path / "out")[0]["eval/prompts"] == 5.0


def test_a_runs_checkpoint_is_evaluated_on_its_evaluation_prompts(tmp_path):
    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.tools.evaluate import CheckpointEvaluator

    run = tiny_run(tmp_path, evaluation={"prompts": 6, "samples_per_prompt": 3})
    model = tiny_model(run.model.vocab_size)
    save_hf(model, model.config, tmp_path / "v0")
    with CheckpointEvaluator(run) as evaluate:
        metrics = evaluate(tmp_path / "v0")
        assert evaluate(tmp_path / "v0")["eval/prompts"] == 6.0  # a second checkpoint: the same prompts and workers
    assert metrics["eval/prompts"] == 6.0 and "eval/pass@3" in metrics
    assert 0.0 <= metrics["eval/truncation_rate"] <= 1.0 and metrics["eval/rewards_failed"] == 0.0
