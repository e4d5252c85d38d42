"""Each bad environment value fails with a message naming the environment, the field, the value and what is allowed
(pure core.environment parsing: the same code app.py runs before building anything)."""
from __future__ import annotations

import copy
import json

import pytest

from infra_helpers import REPO
from moe_rl_eks.core.environment import load_environments, select_environment
from moe_rl_eks.core.schema import ConfigError

CONTEXT = json.loads((REPO / "cdk.json").read_text())["context"]


def _with(env: str, path: str, value) -> dict:
    context = copy.deepcopy(CONTEXT)
    node = context["environments"][env]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return context


@pytest.mark.parametrize("env,path,value,message", [
    ("dev", "trainer_pool.instance_type", "p9.48xlarge",
     "environment 'dev': trainer_pool.instance_type: 'p9.48xlarge' is not allowed; supported: p4d.24xlarge"),
    ("dev", "rollout_pool", {"instance_type": "g6e.2xlarge", "max_size": 2},
     "rollout_pool.efa: True is not allowed; g6e.2xlarge has no EFA; set efa: false or use one of p4d.24xlarge"),
    ("prod", "gpu_availability_zone", "us-east-1a",
     "environment 'prod': gpu_availability_zone: 'us-east-1a' is not allowed; must be one of availability_zones"),
    ("prod", "availability_zones", ["us-east-2a", "eu-west-1b"],
     "availability_zones[1]: 'eu-west-1b' is not allowed; not an availability zone of us-east-2"),
    ("dev", "trainer_pool.min_size", 3, "trainer_pool.min_size: 3 is not allowed; must be <= max_size (2)"),
    ("prod", "trainer_pool.capacity_reservation_id", None,
     "trainer_pool.capacity_reservation_id: None is not allowed; required when capacity_type is CAPACITY_BLOCK"),
    ("prod", "trainer_pool.efa", False,
     "trainer_pool.efa: False is not allowed; a trainer pool of more than one node needs EFA for its collectives"),
    ("dev", "endpoint", {"public": True}, "endpoint.public_cidrs: [] is not allowed; a public endpoint needs an allow-list"),
    ("dev", "trainer_pool.capacity_type", "RESERVED", "trainer_pool.capacity_type: 'RESERVED' is not allowed; allowed: 'ON_DEMAND', 'SPOT', 'CAPACITY_BLOCK'"),
])
def test_bad_environment_fails_with_its_message(env, path, value, message):
    with pytest.raises(ConfigError) as err:
        load_environments(_with(env, path, value))
    assert message in str(err.value)


def test_shipped_environments_parse_and_unknown_name_is_rejected():
    envs = load_environments(CONTEXT)
    assert envs["prod"].trainer_pool.spec.efa_interfaces == 16 and envs["dev"].rollout_pool.efa is False
    with pytest.raises(ConfigError, match="known environments: dev, prod"):
        select_environment(envs, "qa")
