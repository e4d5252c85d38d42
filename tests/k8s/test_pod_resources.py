"""GPU, EFA, hugepages and memory per pod, from the instance catalog and the pool."""
import pytest

from moe_rl_eks.core import labels
from moe_rl_eks.core.catalog import CATALOG
from moe_rl_eks.core.environment import NodePoolConfig
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.k8s.pods import check_shm, rollout_size, trainer_size


@pytest.mark.parametrize("instance, gpus, efa", [
    ("p5.48xlarge", 8, 32),
    ("p5e.48xlarge", 8, 32),
    ("p5en.48xlarge", 8, 16),
    ("p4d.24xlarge", 8, 4),
    ("p6-b200.48xlarge", 8, 8),
    ("g6e.48xlarge", 8, 4),
])
def test_trainer_pod_takes_every_gpu_and_efa_interface_of_its_node(instance, gpus, efa):
    size = trainer_size(NodePoolConfig(instance_type=instance))
    assert (size.gpus, size.efa) == (gpus, efa)
    assert size.hugepages_mib == 5120 * 2  # the pool's default 5120 pages of 2 MiB


def test_every_efa_type_in_the_catalog_gets_its_catalog_efa_count():
    for name, spec in CATALOG.items():
        if spec.has_efa:
            assert trainer_size(NodePoolConfig(instance_type=name)).efa == spec.efa_interfaces, name


def test_trainer_memory_leaves_node_headroom_and_the_hugepages():
    size = trainer_size(NodePoolConfig(instance_type="p5.48xlarge"))
    assert size.memory_mib == int(2048 * 1024 * 0.9) - 10240
    assert size.cpu_millis == 172_000  # 90 % of 192 vCPUs


@pytest.mark.parametrize("instance, efa_pool, gpus_per_server", [
    ("p5e.48xlarge", True, 8), ("p5e.48xlarge", True, 2), ("p5en.48xlarge", True, 1), ("g6e.12xlarge", True, 1),
])
def test_rollout_server_takes_its_gpus_and_no_efa_even_on_an_efa_pool(instance, efa_pool, gpus_per_server):
    size = rollout_size(NodePoolConfig(instance_type=instance, efa=efa_pool), gpus_per_server)
    assert (size.gpus, size.efa, size.hugepages_mib) == (gpus_per_server, 0, 0)
    assert labels.EFA_RESOURCE not in size.resources().requests


def test_shm_larger_than_half_the_pod_memory_is_refused():
    size = rollout_size(NodePoolConfig(instance_type="g6e.xlarge", efa=False), 1)  # 32 GiB node
    with pytest.raises(ConfigError) as err:
        check_shm(size, 16, "deploy.rollout_shm_gib", "run.yaml")
    assert err.value.field == "deploy.rollout_shm_gib" and "at most 14" in str(err.value)
