"""rollout.weight_swap: when a rollout server takes a new weight version in (core/run.py). Its default follows the
run's staleness bound, and a combination that cannot train what it samples is refused when the run loads."""
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.core.run import load_run
from moe_rl_eks.core.schema import ConfigError

LOCAL = Path(__file__).parents[2] / "configs" / "runs" / "local.yaml"


def run_with(tmp_path, weight_swap, max_staleness):
    data = yaml.safe_load(LOCAL.read_text())
    data.setdefault("rollout", {})["weight_swap"] = weight_swap
    data["rl"]["orchestrator"]["max_staleness"] = max_staleness
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    return load_run(tmp_path / "run.yaml")


@pytest.mark.parametrize("weight_swap, max_staleness, applied", [
    (None, 1, "inflight"), (None, 0, "drain"), ("drain", 2, "drain"), ("inflight", 1, "inflight")])
def test_the_swap_mode_defaults_to_inflight_and_to_drain_for_a_synchronous_run(tmp_path, weight_swap, max_staleness,
                                                                                applied):
    assert run_with(tmp_path, weight_swap, max_staleness).weight_swap == applied


def test_inflight_swaps_in_a_synchronous_run_are_refused_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError) as err:
        run_with(tmp_path, "inflight", 0)
    text = str(err.value)
    assert "rollout.weight_swap: 'inflight'" in text and "rl.orchestrator.max_staleness >= 1 (it is 0)" in text
    assert "use drain" in text
    with pytest.raises(ConfigError, match=r"rollout\.weight_swap: 'sometimes'.*inflight.*drain"):
        run_with(tmp_path, "sometimes", 1)
