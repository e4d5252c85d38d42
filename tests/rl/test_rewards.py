"""Built-in task and rewards: exact answers, format, custom by import path, remote HTTP, failures counted."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_rl_eks.core.rl_config import RewardConfig, TaskConfig
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.workloads.rl.rewards import ArithmeticTask, RewardScorer


USER_REWARDS = """
def constant_half(prompt, completion, answer):
    return 0.5

def broken(prompt, completion, answer):
    raise RuntimeError("scorer bug")

def not_a_number(prompt, completion, answer):
    return "high"
"""


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
    scorer = RewardScorer(RewardConfig(correct_weight=1.0, format_weight=0.1))
    assert scorer.score("3+4=", "7", "7", finished=True) == pytest.approx(1.1)
    assert scorer.score("3+4=", "8", "7", finished=True) == pytest.approx(0.1)
    assert scorer.score("3+4=", "7", "7", finished=False) == pytest.approx(1.0)  # cut off: no format credit
    assert scorer.score("3+4=", "7+", "7", finished=True) == 0.0


def test_custom_reward_by_import_path_adds_and_failures_are_counted_not_raised(user_rewards):
    ok = RewardScorer(RewardConfig(format_weight=0.0, custom="user_rewards:constant_half"))
    assert ok.score("1+1=", "2", "2", True) == pytest.approx(1.5)
    bad = RewardScorer(RewardConfig(format_weight=0.0, custom="user_rewards:broken", failure_reward=-1.0))
    assert bad.score("1+1=", "2", "2", True) == pytest.approx(0.0)  # 1 correct + (-1) failure
    nan = RewardScorer(RewardConfig(format_weight=0.0, custom="user_rewards:not_a_number"))
    nan.score("1+1=", "2", "2", True)
    assert (bad.failures, nan.failures) == (1, 1)


def test_custom_reward_that_cannot_be_imported_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="custom.*user_rewards_missing:fn"):
        RewardScorer(RewardConfig(custom="user_rewards_missing:fn"))


class _Remote(BaseHTTPRequestHandler):
    delay_s = 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay_s)
        out = json.dumps({"reward": 0.25 if body["completion"] == body["answer"] else 0.0}).encode()
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
    yield server
    server.shutdown()
    _Remote.delay_s = 0.0


def test_remote_reward_over_http_and_its_timeout_counts_as_failure(remote):
    url = f"http://127.0.0.1:{remote.server_address[1]}/score"
    scorer = RewardScorer(RewardConfig(format_weight=0.0, remote_url=url, remote_timeout_s=0.3))
    assert scorer.score("1+1=", "2", "2", True) == pytest.approx(1.25)
    _Remote.delay_s = 1.0
    start = time.monotonic()
    assert scorer.score("1+1=", "2", "2", True) == pytest.approx(1.0)
    assert time.monotonic() - start < 0.9 and scorer.failures == 1
    down = RewardScorer(RewardConfig(format_weight=0.0, remote_url="http://127.0.0.1:9/none", remote_timeout_s=0.3))
    assert down.score("1+1=", "2", "2", True) == pytest.approx(1.0) and down.failures == 1
