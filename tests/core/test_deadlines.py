"""Request deadlines follow max_tokens and the server's measured per-row decode rate (core/deadlines.py), and a run
whose longest request cannot finish at its declared floor rate within the cap is refused when it loads."""
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.core.deadlines import request_deadline
from moe_rl_eks.core.run import load_run
from moe_rl_eks.core.schema import ConfigError

FLAGSHIP = Path(__file__).parents[2] / "configs" / "runs" / "qwen3-30b-a3b-p5.yaml"


def test_an_8k_token_request_gets_the_slowest_healthy_servers_time_and_is_hedged_at_twice_the_expected():
    d = request_deadline(8192, row_tokens_per_s=50.0, floor_tokens_per_s=20.0, straggler_factor=2.0,
                         allowance_s=30.0, cap_s=900.0)
    assert d.timeout_s == pytest.approx(30 + 8192 / 20) and d.straggler_after_s == pytest.approx(2 * 8192 / 50)


def test_without_a_measured_rate_a_request_is_hedged_after_the_allowance_and_the_cap_bounds_the_deadline():
    d = request_deadline(8192, row_tokens_per_s=None, floor_tokens_per_s=5.0, straggler_factor=2.0,
                         allowance_s=30.0, cap_s=900.0)
    assert (d.timeout_s, d.straggler_after_s) == (900.0, 30.0)
    slow = request_deadline(8192, row_tokens_per_s=4.0, floor_tokens_per_s=5.0, straggler_factor=2.0,
                            allowance_s=30.0, cap_s=900.0)
    assert slow.straggler_after_s == 900.0  # a server slower than the floor is hedged no later than its deadline


def test_a_run_whose_longest_request_cannot_finish_at_its_floor_rate_within_the_cap_is_refused(tmp_path):
    data = yaml.safe_load(FLAGSHIP.read_text())
    data["rl"]["orchestrator"]["request_timeout_s"] = 300
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_run(tmp_path / "run.yaml")
    text = str(err.value)
    assert "rl.orchestrator.request_timeout_s: 300" in text and "must be >= 410 s" in text
    assert "rl.sampling.max_tokens" in text and "20 tokens/s (rollout.min_row_tokens_per_s)" in text
    assert load_run(FLAGSHIP).rl.orchestrator.request_timeout_s == 900
