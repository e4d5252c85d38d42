"""Rewards: the built-in task's exact answer, math-verify, custom functions with verl's signature in worker
processes under a timeout, remote scorers called in concurrent batches, and failures reported as score None
(masked by the orchestrator), never as a made-up score."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_rl_eks.core.rl_config import RewardConfig, TaskConfig
from moe_rl_eks.core.schema import ConfigError, parse
from moe_rl_eks.workloads.rl.data import ArithmeticTask, Prompt
from moe_rl_eks.workloads.rl.rewards import RewardResult, RewardScorer, math_answer_score

USER_REWARDS = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    # verl's signature; a mapping with "score" is accepted as verl's reward functions return one
    bonus = extra_info.get("bonus", 0.0) if data_source == "gsm8k" else 0.0
    return {"score": float(solution_str.strip() == ground_truth) + bonus, "acc": True}

def broken(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "high"
    raise RuntimeError("scorer bug")
"""


def cfg(**fields) -> RewardConfig:
    return parse(RewardConfig, fields, source="test")


def item(completion, truth="7", *, source="gsm8k", extra=None, finished=True):
    return (Prompt(0, (1, 2), "q", source, truth, extra or {}), completion, finished)


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_arithmetic_problems_are_a_pure_function_of_seed_and_index():
    task = ArithmeticTask(TaskConfig(max_operand=9, operators=("+", "*")), seed=3)
    assert task.problem(17) == ArithmeticTask(TaskConfig(max_operand=9, operators=("+", "*")), seed=3).problem(17)
    p = task.problem(17)
    a, op, b = p.prompt[0], p.prompt[1], p.prompt[2]
    assert p.prompt.endswith("=") and int(p.answer) == eval(f"{a}{op}{b}")


def test_exact_answer_and_format_rewards():
    scorer = RewardScorer(cfg(correct_weight=1.0, format_weight=0.1))
    scores = [r.score for r in scorer.score_many([item("7"), item("8"), item("7", finished=False), item("7+")])]
    assert scores == pytest.approx([1.1, 0.1, 1.0, 0.0])  # cut off: no format credit


@pytest.mark.parametrize("completion,truth,correct,answered", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", True, True),
    ("$\\frac{2}{4}$", "\\frac{1}{2}", True, True),
    ("so x = \\boxed{1+x^2}", "x^2+1", True, True),
    ("\\boxed{73}", "72", False, True),
    ("Ann has 5 apples", "5", True, True),
    ("no idea", "5", False, False),
    ("\\boxed{\\sqrt 2}", "$\\sqrt{2}$", True, True),
])
def test_math_verify_compares_answers_not_strings(completion, truth, correct, answered):
    assert math_answer_score(completion, truth) == (correct, answered)


def test_math_reward_in_workers_scores_correct_answers_and_format():
    scorer = RewardScorer(cfg(function="math", correct_weight=1.0, format_weight=0.1, workers=1, timeout_s=30))
    try:
        results = scorer.score_many([item("\\boxed{14/2}"), item("\\boxed{8}"), item("7", finished=False),
                                     item("nothing here")])
    finally:
        scorer.close()
    assert [r.score for r in results] == pytest.approx([1.1, 0.1, 1.0, 0.0]) and scorer.failures == 0


def test_custom_function_gets_verls_arguments(user_rewards):
    scorer = RewardScorer(cfg(function="user_rewards:compute_score", workers=2))
    try:
        results = scorer.score_many([item("7", extra={"bonus": 0.5}), item("8", source="math"), item("7")])
    finally:
        scorer.close()
    assert results == [RewardResult(1.5, None), RewardResult(0.0, None), RewardResult(1.0, None)]


def test_failed_rewards_are_none_with_the_reason_and_a_hung_call_is_killed(user_rewards):
    scorer = RewardScorer(cfg(function="user_rewards:broken", workers=1, timeout_s=3))
    try:
        results = scorer.score_many([item("boom"), item("nan"), item("text"), item("hang"), item("boom")])
        pid_after = scorer._pool.idle.queue[0].proc.pid
        again = scorer.score_many([item("boom")])
        pid_again = scorer._pool.idle.queue[0].proc.pid
    finally:
        scorer.close()
    assert all(r.score is None for r in results + again)
    assert "RuntimeError: scorer bug" in results[0].error and "nan" in results[1].error
    assert "'high'" in results[2].error and "rl.reward.timeout_s (3 s)" in results[3].error
    assert "RuntimeError" in results[4].error  # the replacement worker scores the next item
    assert pid_after == pid_again  # a failure that is not a timeout keeps its worker
    assert (scorer.failures, scorer.calls) == (6, 6)


def test_a_custom_function_that_cannot_be_imported_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="function.*user_rewards_missing:fn"):
        RewardScorer(cfg(function="user_rewards_missing:fn"))
    with pytest.raises(ConfigError, match=r"test: function: 'nope' is not allowed; expected 'arithmetic', 'countdown', 'math'"):
        cfg(function="nope")
    with pytest.raises(ConfigError, match=r"test: timeout_s: 0.0 is not allowed; must be > 0"):
        cfg(timeout_s=0)


class _Remote(BaseHTTPRequestHandler):
    """Scores 1 for a completion equal to the ground truth, null for "?"; waits until `together` requests are in
    flight at once (or fails them), so a scorer that sends batches one after another fails the test."""

    together = 1
    seen: list[int] = []
    barrier: threading.Barrier | None = None

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        _Remote.seen.append(len(items))
        try:
            _Remote.barrier.wait(timeout=5)
        except threading.BrokenBarrierError:
            self.send_response(503)
            self.end_headers()
            return
        scores = [None if i["solution_str"] == "?" else float(i["solution_str"] == i["ground_truth"]) for i in items]
        out = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def remote():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Remote)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


def test_remote_reward_sends_concurrent_batches_and_masks_failures(remote):
    _Remote.seen, _Remote.barrier = [], threading.Barrier(4)
    scorer = RewardScorer(cfg(remote_url=remote, remote_batch_size=3, max_concurrency=4, timeout_s=10))
    completions = ["7", "8", "?", "7", "7", "1", "7", "7", "7", "0"]
    results = scorer.score_many([item(c) for c in completions])
    assert sorted(_Remote.seen) == [1, 3, 3, 3]  # 10 items in batches of 3, all four in flight together
    assert [r.score for r in results] == [1.0, 0.0, None, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert "expected a finite number" in results[2].error and scorer.failures == 1


def test_remote_reward_timeout_and_unreachable_server_fail_whole_batches(remote):
    _Remote.seen, _Remote.barrier = [], threading.Barrier(2)  # one request alone never gets an answer in time
    slow = RewardScorer(cfg(remote_url=remote, remote_batch_size=8, timeout_s=0.5))
    results = slow.score_many([item("7"), item("7")])
    assert [r.score for r in results] == [None, None] and "timed out" in results[0].error
    down = RewardScorer(cfg(remote_url="http://127.0.0.1:9/none", timeout_s=0.5))
    result = down.score_many([item("7")])[0]
    assert result.score is None and "127.0.0.1:9" in result.error and down.failures == 1


def test_workers_start_whatever_the_parents_main_is(tmp_path):
    """A parent run from stdin (or a notebook) has no __main__ file for multiprocessing's spawn to re-run."""
    import subprocess
    import sys

    script = ("from moe_rl_eks.core.rl_config import RewardConfig\n"
              "from moe_rl_eks.workloads.rl.data import Prompt\n"
              "from moe_rl_eks.workloads.rl.rewards import RewardScorer\n"
              "s = RewardScorer(RewardConfig(function='math', workers=1))\n"
              "r = s.score_many([(Prompt(0, (1,), 'q', 'm', '1/2', {}), '\\\\boxed{0.5}', True)])\n"
              "s.close()\nprint(r[0].score)\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "1.1", out.stderr[-2000:]


def test_a_worker_that_cannot_start_is_an_error_not_a_masked_sample(tmp_path, monkeypatch):
    from moe_rl_eks.workloads.rl.rewards import RewardWorkerError

    (tmp_path / "parent_only.py").write_text(
        "import os\nif os.getpid() != int(os.environ['REWARD_PARENT_PID']):\n    raise ImportError('not here')\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REWARD_PARENT_PID", str(__import__("os").getpid()))
    scorer = RewardScorer(cfg(function="parent_only:score", workers=1))
    try:
        with pytest.raises(RewardWorkerError, match="exited with code 1 before it started"):
            scorer.score_many([item("7")])
    finally:
        scorer.close()
