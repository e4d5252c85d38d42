"""Every bad environment setting fails at load with the environment, field, value and what is allowed."""
import copy
import json
from pathlib import Path

import pytest

from moe_rl_eks.core.environment import load_environments, select_environment
from moe_rl_eks.core.schema import ConfigError

CONTEXT = json.loads((Path(__file__).parents[2] / "cdk.json").read_text())["context"]


def _load_with(env: str, patch) -> None:
    context = copy.deepcopy(CONTEXT)
    patch(context["environments"][env])
    load_environments(context)


def test_shipped_environments_load():
    envs = load_environments(CONTEXT)
    assert set(envs) >= {"dev", "prod"}
    assert envs["prod"].trainer_pool.spec.efa_interfaces == 16
    assert envs["dev"].rollout_pool.efa is False
    assert all(e.name == n for n, e in envs.items())


def _set(path: str, value):
    def patch(env):
        *parents, leaf = path.split(".")
        for p in parents:
            env = env[p]
        env[leaf] = value
    return patch


@pytest.mark.parametrize("env, path, value, fragment", [
    ("dev", "trainer_pool.instance_type", "p9.large", "supported: p4d.24xlarge"),
    ("dev", "rollout_pool", {"instance_type": "g6e.2xlarge", "efa": True}, "g6e.2xlarge has no EFA; set efa: false"),
    ("dev", "gpu_availability_zone", "us-west-2a", "must be one of availability_zones"),
    ("dev", "availability_zones", ["us-east-1a", "eu-west-1b"], "not an availability zone of us-east-1"),
    ("dev", "trainer_pool.min_size", 3, "must be <= max_size (2)"),
    ("dev", "trainer_pool.desired_size", 5, "must be between min_size (0) and max_size (2)"),
    ("dev", "trainer_pool.capacity_type", "CAPACITY_BLOCK", "required when capacity_type is CAPACITY_BLOCK"),
    ("dev", "trainer_pool.capacity_type", "RESERVED", "allowed: 'ON_DEMAND', 'SPOT', 'CAPACITY_BLOCK'"),
    ("dev", "trainer_pool.efa", False, "a trainer pool of more than one node needs EFA"),
    ("dev", "endpoint", {"public": True}, "a public endpoint needs an allow-list"),
    ("dev", "endpoint", {"public": True, "public_cidrs": ["0.0.0.0/0"]}, "the whole internet is not an allow-list"),
    ("dev", "kubernetes_version", "1.21", "supported: 1.35, 1.36"),
    ("dev", "kubernetes_version", "1.37", "supported: 1.35, 1.36"),
    ("dev", "cluster_names", {"trainer_queue": "Research_Q"}, "expected a Kubernetes object name"),
    ("dev", "cluster_names", {"rollout_priority_class": "system-node-critical"}, "the system- prefix is reserved"),
    ("dev", "account", "12345", "12-digit"),
    ("dev", "vpc_cidr", "8.8.0.0/16", "private CIDR"),
    ("prod", "vpc_cidr", "10.40.0.0/17", "too small for one /24 public, /19 private, /28 scraper subnet in each of the 3 zones"),
    ("prod", "storage.fsx_storage_capacity_gib", 2000, "1200 or a multiple of 2400"),
    ("prod", "trainer_pool.capacity_reservation_id", "reservation-1", "cr-0123456789abcdef0"),
    ("prod", "rollout_pool.desired_size", 2, "a GPU pool starts at 0 nodes unless a capacity reservation backs it"),
    ("prod", "trainer_pool.desired_size", 4, "a Capacity Block pool is created at 0 nodes: its instances exist "
     "only while the block is active, and a node group created before then (or with fewer free instances) fails and "
     "rolls the whole stack back; scale it once the block is active with `moerl scale-pool`"),
    ("prod", "admin_role_arn", None, "required: the IAM role that administers the cluster"),
    ("prod", "admin_role_arn", "arn:aws:iam::222222222222:user/alice", "expected an IAM role ARN"),
    ("dev", "endpoint", {"public": True, "public_cidrs": "203.0.113.0/24"}, "expected a list"),
    ("dev", "endpoint", {"public": True, "public_cidrs": ["10.0.0.0/33"]}, "expected a CIDR"),
])
def test_bad_environment_fails_naming_environment_field_and_value(env, path, value, fragment):
    with pytest.raises(ConfigError) as err:
        _load_with(env, _set(path, value))
    msg = str(err.value)
    assert f"environment {env!r}" in msg
    assert path.split(".")[0] in msg
    assert fragment in msg


def test_unknown_field_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"trainer_pool.gpus: 8 is not allowed; unknown field; known fields: capacity_reservation_id"):
        _load_with("dev", _set("trainer_pool.gpus", 8))


def test_unknown_environment_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="env: 'qa' is not allowed; known environments: dev, prod"):
        select_environment(load_environments(CONTEXT), "qa")


def test_kubernetes_1_36_is_accepted_and_1_35_stays_the_default():
    context = copy.deepcopy(CONTEXT)
    del context["environments"]["dev"]["kubernetes_version"]
    context["environments"]["prod"]["kubernetes_version"] = "1.36"
    envs = load_environments(context)
    assert (envs["dev"].kubernetes_version, envs["prod"].kubernetes_version) == ("1.35", "1.36")
