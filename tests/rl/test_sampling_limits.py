"""One set of sampling limits (core/sampling.py): a run the rollout servers would refuse does not load, and the run
configuration, the HTTP schema and the engine accept and refuse the same values at every bound."""
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from moe_rl_eks.core import sampling as limits
from moe_rl_eks.core.run import load_run
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.workloads.rollout.engine_api import SamplingParams
from moe_rl_eks.workloads.rl.openai_api import CompletionRequest

LOCAL_RUN = Path(__file__).parents[2] / "configs" / "runs" / "local.yaml"


def load_with(tmp_path, section: str, **values):
    data = yaml.safe_load(LOCAL_RUN.read_text())
    data["rl"].setdefault(section, {}).update(values)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_run(path)


def test_a_run_whose_temperature_the_servers_refuse_is_refused_when_loaded(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_with(tmp_path, "sampling", temperature=12)
    text = str(err.value)
    assert "rl.sampling.temperature" in text and "12" in text and "[0, 10]" in text, text
    # and the server would indeed refuse it, as would the engine
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[1], temperature=12)
    with pytest.raises(ValueError, match=r"temperature: 12 is not allowed; a number in \[0, 10\]"):
        SamplingParams(max_tokens=1, temperature=12)


def test_an_evaluation_the_servers_refuse_is_refused_when_loaded(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.evaluation\.temperature.*\[0, 10\]"):
        load_with(tmp_path, "evaluation", temperature=10.5)
    # periodic evaluation goes through the servers, with their caps on n and lengths
    with pytest.raises(ConfigError, match=r"rl\.evaluation\.samples_per_prompt.*rl\.sampling\.max_n"):
        load_with(tmp_path, "evaluation", every_steps=10, samples_per_prompt=65)
    with pytest.raises(ConfigError, match=r"rl\.evaluation\.max_tokens.*rollout\.max_new_tokens"):
        load_with(tmp_path, "evaluation", every_steps=10, max_tokens=9)
    # the final evaluation samples in-process, without them
    assert load_with(tmp_path, "evaluation", every_steps=0, samples_per_prompt=65).rl.evaluation.samples_per_prompt == 65


def test_greedy_sampling_is_refused_for_training_with_its_reason(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.sampling\.temperature.*greedy decoding is not used for RL"):
        load_with(tmp_path, "sampling", temperature=0)


# (limit, values just inside, values just outside)
BOUNDS = [
    (limits.TEMPERATURE, [0, 0.0, 10, 10.0], [-0.001, 10.001, float("nan"), float("inf")]),
    (limits.TOP_P, [1e-9, 1, 1.0], [0, 0.0, 1.0001]),
    (limits.MIN_P, [0, 1], [-0.1, 1.1]),
    (limits.MAX_TOKENS, [1, 2**20], [0, -1]),
    (limits.SEED, [0, limits.SEED_LIMIT - 1], [-1, limits.SEED_LIMIT]),
    (limits.TOP_K, [0, 50], [-2]),
]


def http_allows(name: str, value) -> bool:
    try:
        CompletionRequest(prompt=[1], **{name: value})
        return True
    except ValidationError:
        return False


def engine_allows(name: str, value) -> bool:
    try:
        SamplingParams(**{"max_tokens": 1, name: value})
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("limit, inside, outside", BOUNDS, ids=[b[0].name for b in BOUNDS])
def test_the_http_schema_and_the_engine_take_exactly_the_values_the_limits_allow(limit, inside, outside):
    for value in inside:
        assert limit.allows(value) and http_allows(limit.name, value) and engine_allows(limit.name, value), value
    for value in outside:
        assert not limit.allows(value) and not engine_allows(limit.name, value), value
        # vLLM's -1 = off is an HTTP spelling of the engine's 0: the one value the schema takes beyond the limit
        assert not http_allows(limit.name, value), value
    if limit is limits.TOP_K:
        assert http_allows("top_k", -1)


@pytest.mark.parametrize("section, field, value", [
    ("sampling", "temperature", 10.0001), ("sampling", "top_p", 0), ("sampling", "top_p", 1.5),
    ("sampling", "max_tokens", 0), ("evaluation", "max_tokens", 0),
])
def test_every_run_setting_the_servers_check_is_checked_against_the_same_limit(tmp_path, section, field, value):
    with pytest.raises(ConfigError) as err:
        load_with(tmp_path, section, **{field: value})
    assert f"rl.{section}.{field}" in str(err.value) and "the rollout servers refuse anything else" in str(err.value)


def test_an_rl_run_sampling_a_nucleus_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.sampling\.top_p: 0\.9 .*must be 1 for RL: .*biased low"):
        load_with(tmp_path, "sampling", top_p=0.9)
