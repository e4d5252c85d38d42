"""A run is checked against its environment and its EP backend resolved once, by the rule in core.ep_backends."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_rl_eks.core.deploy import DeployConfig, ImagesConfig
from moe_rl_eks.core.ep_backends import Topology, UnsupportedBackend, check_backend, resolve_backend
from moe_rl_eks.core.environment import load_environments
from moe_rl_eks.core.rl_config import RLConfig, TrainingConfig, WeightStoreConfig
from moe_rl_eks.core.run import ModelConfig, ParallelismConfig, RolloutConfig, RunConfig, resolve_run
from moe_rl_eks.core.schema import ConfigError, parse

ENVS = load_environments(json.loads((Path(__file__).parents[2] / "cdk.json").read_text())["context"])
# Qwen3-30B-A3B's published shape.
QWEN3_30B = ModelConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                        num_experts_per_tok=8)
TINY = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)

# What any cluster run carries besides its shape: images, and checkpoints and weights on the shared FSx volume.
CLUSTER_READY = dict(
    deploy=DeployConfig(images=ImagesConfig(trainer="v1.0.0", rollout="v1.0.0", orchestrator="v1.0.0")),
    rl=RLConfig(training=TrainingConfig(output_dir="/fsx/runs/q"), weights=WeightStoreConfig(kind="fs", path="/fsx/runs/q/weights")))


def test_parameter_count_matches_qwen3_30b_a3b():
    assert 30.0e9 < QWEN3_30B.parameter_count() < 31.0e9  # published: 30.5 B


@pytest.mark.parametrize("nodes, ranks, device, expected", [
    (1, 1, "cuda", "local"),
    (1, 2, "cpu", "alltoall"),
    (1, 8, "cuda", "deepep"),
    (1, 6, "cuda", "alltoall"),  # DeepEP intranode takes 2, 4 or 8 ranks: falls back
    (4, 8, "cuda", "alltoall"),
    (8, 8, "cuda", "alltoall"),
    (16, 8, "cuda", "alltoall"),  # stock DeepEP cannot run between nodes over EFA
    (32, 8, "cuda", "alltoall"),
])
def test_auto_picks_backend_by_topology(nodes, ranks, device, expected):
    topo = Topology(nodes=nodes, ranks_per_node=ranks, device=device, num_experts=nodes * ranks * 2)
    assert resolve_backend("auto", topo)[0] == expected


@pytest.mark.parametrize("nodes, expected", [(8, "alltoall"), (16, "deepep"), (20, "deepep"),
                                             (32, "alltoall")])  # 256 ranks: past DeepEP's 160
def test_auto_picks_deepep_between_nodes_only_when_the_image_runs_it_over_efa(nodes, expected):
    topo = Topology(nodes=nodes, ranks_per_node=8, device="cuda", num_experts=nodes * 16, deepep_internode=True)
    assert resolve_backend("auto", topo)[0] == expected


def test_explicit_deepep_between_nodes_without_an_efa_capable_image_says_what_it_needs():
    with pytest.raises(UnsupportedBackend, match="deploy.images.deepep_efa: true"):
        resolve_backend("deepep", Topology(16, 8, "cuda", 128))


@pytest.mark.parametrize("topo, fragment", [
    (Topology(1, 6, "cuda", 12), "intranode needs (2, 4, 8) ranks, not 6"),
    (Topology(2, 4, "cuda", 16, deepep_internode=True), "internode needs 8 ranks per node and 16 to 160 ranks"),
    (Topology(1, 4, "cpu", 8), "needs CUDA GPUs"),
    (Topology(1, 4, "cuda", 6), "num_experts (6) must be divisible by the expert-parallel size (4)"),
    (Topology(1, 8, "cuda", 16, dtype="float32"), "moves bfloat16 tokens; the model's dtype is float32"),
])
def test_deepep_limits_are_named(topo, fragment):
    with pytest.raises(UnsupportedBackend, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_backend("deepep", topo)


def test_local_run_resolves_to_two_gloo_ranks():
    resolved = resolve_run(RunConfig(name="local", model=TINY), None)
    assert (resolved.topology.ep_size, resolved.ep_backend) == (2, "alltoall")


def test_prod_run_on_p5en_resolves_against_its_pools():
    run = RunConfig(name="q", model=QWEN3_30B, environment="prod",
                    parallelism=ParallelismConfig(trainer_nodes=4), rollout=RolloutConfig(max_servers=8), **CLUSTER_READY)
    resolved = resolve_run(run, ENVS["prod"])
    assert resolved.topology.ep_size == 32
    assert resolved.ep_backend == "alltoall"


@pytest.mark.parametrize("env, run_kwargs, field, fragment", [
    ("prod", dict(parallelism=ParallelismConfig(trainer_nodes=17)), "parallelism.trainer_nodes", "at most 16 nodes"),
    ("dev", dict(rollout=RolloutConfig(gpus_per_server=1, max_servers=1)), "rollout.gpus_per_server",
     "GiB of weights need more than 80 % of 1 x 45 GiB (L40S)"),
    ("dev", dict(rollout=RolloutConfig(gpus_per_server=8)), "rollout.gpus_per_server", "g6e.12xlarge has 4 GPUs"),
    ("dev", dict(rollout=RolloutConfig(gpus_per_server=4, max_servers=3)), "rollout.max_servers", "fits at most 2 servers"),
    ("dev", dict(model=replace(TINY, num_experts=12), parallelism=ParallelismConfig(ep_backend="deepep", ranks_per_node=6)),
     "parallelism.ep_backend", "intranode needs (2, 4, 8) ranks, not 6"),
])
def test_run_that_does_not_fit_its_environment_is_refused(env, run_kwargs, field, fragment):
    run = RunConfig(name="q", environment=env, **{"model": QWEN3_30B, **run_kwargs})
    with pytest.raises(ConfigError) as err:
        resolve_run(run, ENVS[env])
    assert err.value.field == field
    assert fragment in str(err.value)


def test_ep_degree_must_divide_experts():
    run = RunConfig(name="q", model=replace(QWEN3_30B, num_experts=120, n_group=1), environment="prod",
                    parallelism=ParallelismConfig(trainer_nodes=2), rollout=RolloutConfig(max_servers=8))
    with pytest.raises(ConfigError, match=r"num_experts \(120\) must be divisible by the expert-parallel size \(16\)"):
        resolve_run(run, ENVS["prod"])


@pytest.mark.parametrize("patch, field, fragment", [
    ({"num_key_value_heads": 3}, "model.num_key_value_heads", "must divide num_attention_heads (4)"),
    ({"num_experts_per_tok": 9}, "model.num_experts_per_tok", "must be <= num_experts (8)"),
    ({"router": "sigmoid", "n_group": 3}, "model.n_group", "must divide num_experts (8)"),
    ({"n_group": 2}, "model.n_group", "group-limited routing needs router: sigmoid"),
    ({"router": "sigmoid", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 4}, "model.topk_group",
     "fewer experts than num_experts_per_tok"),
])
def test_model_config_invariants(patch, field, fragment):
    data = {"name": "x", "model": {**TINY.__dict__, **patch}}
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, data, source="run.yaml")
    assert err.value.field == field and fragment in str(err.value)


def test_triton_compute_is_refused_for_a_cpu_run():
    with pytest.raises(ConfigError, match="moe_compute: 'triton' is not allowed; the triton kernels need CUDA GPUs"):
        resolve_run(RunConfig(name="local", model=TINY, moe_compute="triton"), None)


@pytest.mark.parametrize("rl, field, fragment", [
    ({"sampling": {"max_tokens": 300}}, "rl.sampling.max_tokens", "must be <= rollout.max_new_tokens (256)"),
    ({"algorithm": {"group_size": 65}}, "rl.algorithm.group_size", "must be <= rl.sampling.max_n (64)"),
])
def test_what_the_orchestrator_asks_must_be_what_rollout_servers_accept(rl, field, fragment):
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {"name": "x", "model": dict(TINY.__dict__), "rl": rl}, source="run.yaml")
    assert err.value.field == field and fragment in str(err.value)


def test_a_rollout_server_must_split_the_experts_evenly_over_its_gpus():
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {"name": "x", "model": {**TINY.__dict__, "num_experts": 8}, "rollout": {"gpus_per_server": 3}},
              source="run.yaml")
    assert err.value.field == "rollout.gpus_per_server" and err.value.value == 3
    assert "must divide model.num_experts (8)" in str(err.value)


@pytest.mark.parametrize("field,size", [("hidden_size", 36), ("moe_intermediate_size", 20)])
def test_the_triton_compute_backend_refuses_expert_rows_its_tma_loads_cannot_read(field, size):
    model = {**TINY.__dict__, field: size}
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {"name": "x", "model": model, "moe_compute": "triton"}, source="run.yaml")
    assert err.value.field == f"model.{field}" and err.value.value == size
    assert "multiple of 8 with moe_compute: triton" in str(err.value)
    parse(RunConfig, {"name": "x", "model": model}, source="run.yaml")  # the torch backend takes any size


def test_a_float32_model_on_one_gpu_node_falls_back_from_deepep_to_all_to_all():
    run = RunConfig(name="fp32", model=replace(TINY, dtype="float32"), environment="dev", **CLUSTER_READY)
    resolved = resolve_run(run, ENVS["dev"])
    assert resolved.ep_backend == "alltoall" and "moves bfloat16 tokens" in resolved.ep_backend_reason


def test_a_resolved_multi_node_trainer_refuses_a_node_local_weight_store_naming_the_field():
    from moe_rl_eks.core.run import resolved_run_file

    run = RunConfig(name="q", model=QWEN3_30B, environment="prod", parallelism=ParallelismConfig(trainer_nodes=2),
                    rollout=RolloutConfig(max_servers=8), **CLUSTER_READY)
    shipped = resolved_run_file(resolve_run(run, ENVS["prod"]))  # the run file the trainer pods read
    assert resolve_run(shipped, None).topology.nodes == 2

    def with_weights(store, output_dir="/fsx/runs/q"):
        return replace(shipped, rl=replace(shipped.rl, weights=store,
                                           training=replace(shipped.rl.training, output_dir=output_dir)))

    with pytest.raises(ConfigError) as err:  # rank 0 would wait for the other node's parts forever
        resolve_run(with_weights(WeightStoreConfig(kind="local", path="/tmp/weights")), None)
    assert (err.value.field, err.value.value) == ("rl.weights.path", "/tmp/weights")
    assert "a trainer on 2 nodes" in str(err.value) and "kind: s3, or kind: fs (or local) with a path under /fsx/" \
        in str(err.value)
    with pytest.raises(ConfigError) as err:  # no path: <output_dir>/weights, here on the node's disk
        resolve_run(with_weights(WeightStoreConfig(kind="local"), output_dir="/data/q"), None)
    assert (err.value.field, err.value.value) == ("rl.weights.kind", "local") and "'/data/q/weights'" in str(err.value)
    # Shared by the nodes: the FSx volume (either directory kind) or S3.
    for store in (WeightStoreConfig(kind="local"), WeightStoreConfig(kind="fs", path="/fsx/runs/q/weights"),
                  WeightStoreConfig(kind="s3", bucket="b")):
        assert resolve_run(with_weights(store), None).topology.nodes == 2
    one_node = replace(shipped, resolved=replace(shipped.resolved, topology=replace(shipped.resolved.topology, nodes=1)))
    one_node = replace(one_node, rl=replace(one_node.rl, weights=WeightStoreConfig(kind="local", path="/tmp/weights")))
    assert resolve_run(one_node, None).topology.nodes == 1  # one node writes every part itself
