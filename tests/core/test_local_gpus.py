"""A local run on this machine's GPUs: roles placed by `local_gpus`, memory shares checked when the run is loaded,
and a machine that cannot hold the run refused before any role starts, naming the field and the numbers."""
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.core import memory, planner
from moe_rl_eks.core.run import check_local_gpus, check_local_machine, load_run, resolve_run
from moe_rl_eks.core.schema import ConfigError

LOCAL = Path(__file__).parents[2] / "configs" / "runs" / "local.yaml"
GIB = 2**30
H200 = 140 * GIB


def gpu_run(tmp_path, local_gpus, **changes):
    data = yaml.safe_load(LOCAL.read_text())
    data["local_gpus"] = local_gpus
    data["parallelism"] = {"ep_backend": "auto"}
    data["rollout"].update(min_servers=1, max_servers=1)
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_run(path)


ONE_GPU = {"trainer": {"gpus": [0], "memory_share": 0.5}, "rollout": {"gpus": [0], "memory_share": 0.4}}


def test_a_one_gpu_run_trains_on_one_cuda_rank_without_expert_parallel_traffic_and_may_use_triton(tmp_path):
    run = gpu_run(tmp_path, ONE_GPU, moe_compute="triton")
    resolved = resolve_run(run, None)
    assert resolved.topology.device == "cuda" and resolved.topology.ep_size == 1
    assert resolved.ep_backend == "local"
    assert run.server_gpus(0) == (0,)


def test_memory_shares_over_one_on_a_gpu_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as err:
        gpu_run(tmp_path, {"trainer": {"gpus": [0], "memory_share": 0.7}, "rollout": {"gpus": [0], "memory_share": 0.4}})
    text = str(err.value)
    assert "local_gpus.rollout.memory_share" in text and "0.7" in text and "0.4" in text and "1.10 of GPU 0" in text


def test_roles_on_separate_gpus_may_each_take_all_of_their_gpu(tmp_path):
    run = gpu_run(tmp_path, {"trainer": {"gpus": [1], "memory_share": 1.0}, "rollout": {"gpus": [0], "memory_share": 1.0}})
    assert run.local_gpus.shares_by_gpu() == {0: 1.0, 1: 1.0}


@pytest.mark.parametrize("local_gpus, changes, field, fragment", [
    ({"trainer": {"gpus": [0, 0]}, "rollout": {"gpus": [1]}}, {}, "local_gpus.trainer.gpus", "one trainer rank"),
    ({"trainer": {"gpus": [0], "memory_share": 0}, "rollout": {"gpus": [1]}}, {}, "local_gpus.trainer.memory_share",
     "(0, 1]"),
    ({"trainer": {"gpus": [0, 1]}, "rollout": {"gpus": [2]}}, {"parallelism": {"ranks_per_node": 1}},
     "parallelism.ranks_per_node", "one trainer rank per GPU"),
    ({"trainer": {"gpus": [0]}, "rollout": {"gpus": [0, 1]}}, {}, "local_gpus.rollout.gpus", "must list 1 GPUs"),
])
def test_a_placement_that_cannot_run_is_refused_at_load(tmp_path, local_gpus, changes, field, fragment):
    with pytest.raises(ConfigError) as err:
        gpu_run(tmp_path, local_gpus, **changes)
    assert field in str(err.value) and fragment in str(err.value), str(err.value)


def test_a_role_given_a_gpu_the_machine_lacks_is_refused(tmp_path):
    run = gpu_run(tmp_path, {"trainer": {"gpus": [1], "memory_share": 0.5}, "rollout": {"gpus": [0], "memory_share": 0.4}})
    with pytest.raises(ConfigError, match=r"local_gpus.trainer.gpus.*GPU 1 is not on this machine, which has 1"):
        check_local_machine(run, [H200])
    check_local_machine(run, [H200, H200])


SPLIT = {"trainer": {"gpus": [0], "memory_share": 1.0}, "rollout": {"gpus": [1], "memory_share": 1.0}}


@pytest.mark.parametrize("count, fragment", [(1, "GPU 1 is not on this machine, which has 1 (0..0)"),
                                             (0, "GPU 0 is not on this machine, which has 0 (no CUDA device visible)")])
def test_a_split_run_on_a_machine_with_fewer_gpus_is_refused_naming_the_field_value_and_the_count(tmp_path, count,
                                                                                                  fragment):
    run = gpu_run(tmp_path, SPLIT)
    with pytest.raises(ConfigError) as err:
        check_local_gpus(run, count, source="run.yaml")
    text = str(err.value)
    field = "local_gpus.rollout.gpus: [1]" if count else "local_gpus.trainer.gpus: [0]"  # the first role lacking one
    assert field in text and fragment in text, text
    check_local_gpus(run, 2, source="run.yaml")  # an H200 x2 holds it


def activations(run):
    t = run.rl.training
    return planner.activation_bytes(run.model, run.model.num_hidden_layers, t.max_tokens_per_microbatch,
                                    t.activation_checkpointing)


def test_a_colocated_run_whose_trainer_state_does_not_fit_its_share_is_refused_with_the_numbers(tmp_path):
    # 8 layers of Qwen3-30B-A3B's shape: ~4.8 B parameters, 16 bytes each for the trainer's float32 state
    shape = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
             "num_experts_per_tok": 8, "max_position_embeddings": 40960, "dtype": "bfloat16"}
    rl = {"algorithm": {"name": "grpo", "group_size": 8, "kl_coef": 0.0}, "weights": {"device_transfer": False},
          "training": {"activation_checkpointing": "full"}}
    run = gpu_run(tmp_path, ONE_GPU, model=shape, rl=rl)
    state = run.model.parameter_count() * 16 + memory.CUDA_OVERHEAD_BYTES
    need = state + activations(run)
    assert 80 * GIB < state < 90 * GIB and 5 * GIB < need - state < 6 * GIB
    with pytest.raises(ConfigError) as err:
        check_local_machine(run, [H200])
    text = str(err.value)
    assert "local_gpus.trainer.memory_share" in text and "0.5 of GPU 0's 140.0 GiB is 70.0 GiB" in text, text
    assert (f"the trainer needs {need / GIB:.1f} GiB there (float32 weights, gradients and AdamW state, and "
            "16384-token micro-batches' activations)") in text
    fits = {"trainer": {"gpus": [0], "memory_share": 0.7}, "rollout": {"gpus": [0], "memory_share": 0.3}}
    check_local_machine(gpu_run(tmp_path, fits, model=shape, rl=rl), [H200])


def test_a_colocated_trainer_also_holds_the_export_of_the_served_weights_unless_device_transfer_is_off(tmp_path):
    shape = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
             "num_experts_per_tok": 8, "max_position_embeddings": 40960, "dtype": "bfloat16"}
    rl = {"algorithm": {"name": "grpo", "group_size": 8, "kl_coef": 0.0}, "training": {"activation_checkpointing": "full"}}
    share = {"trainer": {"gpus": [0], "memory_share": 0.68}, "rollout": {"gpus": [0], "memory_share": 0.3}}
    run = gpu_run(tmp_path, share, model=shape, rl=rl)
    assert run.weights_over_device
    need = run.model.parameter_count() * (16 + 2) + memory.CUDA_OVERHEAD_BYTES + activations(run)  # + bf16 export
    with pytest.raises(ConfigError) as err:
        check_local_machine(run, [H200])
    assert (f"the trainer needs {need / GIB:.1f} GiB there (float32 weights, gradients and AdamW state and the "
            "weights' export to the rollout server, and 16384-token micro-batches' activations)") in str(err.value)
    off = gpu_run(tmp_path, share, model=shape, rl={**rl, "weights": {"device_transfer": False}})
    assert not off.weights_over_device
    check_local_machine(off, [H200])  # 0.68 x 140 GiB holds the state without the export


def test_only_a_one_rank_trainer_and_one_gpu_server_on_the_same_gpu_exchange_weights_over_device_memory(tmp_path):
    assert gpu_run(tmp_path, ONE_GPU).weights_over_device
    apart = {"trainer": {"gpus": [1], "memory_share": 0.5}, "rollout": {"gpus": [0], "memory_share": 0.4}}
    assert not gpu_run(tmp_path, apart).weights_over_device
    assert not load_run(LOCAL).weights_over_device  # on the CPU


def test_the_trainer_state_splits_the_routed_experts_over_its_ranks_and_the_rest_by_fsdp_reference_too():
    one = memory.trainer_memory(replicated=100, experts=800, ranks=1, reference=False)
    four = memory.trainer_memory(replicated=100, experts=800, ranks=4, reference=True)
    assert one.fixed_bytes - memory.CUDA_OVERHEAD_BYTES == 900 * 16
    assert four.fixed_bytes - memory.CUDA_OVERHEAD_BYTES == 300 * 20  # 100 + 800 / 4, plus a float32 reference
    # FSDP shards the dense 100 too (ceil 100 / 3 = 34 a rank), the frozen reference's as the policy's
    sharded = memory.trainer_memory(replicated=100, experts=900, ranks=3, reference=True, fsdp=True)
    assert sharded.fixed_bytes - memory.CUDA_OVERHEAD_BYTES == (34 + 300) * 16 + (34 + 300) * 4
    assert memory.trainer_state(replicated=100, experts=900, ranks=3, fsdp=True).optimizer_bytes == (34 + 300) * 8
    kv = memory.rollout_memory(replicated=10, experts=40, gpus=2, dtype_bytes=2, layers=8, kv_heads=4, head_dim=128)
    assert kv.per_token_bytes == 2 * 8 * 4 * 128 * 2 and kv.fixed_bytes - memory.CUDA_OVERHEAD_BYTES == 30 * 2


def test_the_local_run_refuses_gpus_the_machine_lacks_then_shows_each_role_only_its_gpus_one_trainer_rank_per_gpu(
        tmp_path, monkeypatch):
    from moe_rl_eks.tools import local_run

    run = gpu_run(tmp_path, {"trainer": {"gpus": [2, 3], "memory_share": 1.0}, "rollout": {"gpus": [0, 1]}},
                  rollout={"min_servers": 2, "max_servers": 2}, rl={"training": {"output_dir": str(tmp_path / "out")}})
    started = []

    class Recorder:  # what the cluster hands the OS: the argv and environment of each role
        def __init__(self, argv, env, **_):
            started.append((argv, env))
            self.pid = 0

    monkeypatch.setattr(local_run.subprocess, "Popen", Recorder)
    monkeypatch.setattr(local_run, "gpu_count", lambda: 2)  # a machine of two GPUs: GPUs 2 and 3 are not there
    refusal = r"local_gpus.trainer.gpus: \[2, 3\].*GPU 2 is not on this machine, which has 2"
    with pytest.raises(ConfigError, match=refusal):
        local_run.LocalCluster(str(tmp_path / "run.yaml"), run)
    assert started == []  # refused before any role started
    monkeypatch.setattr(local_run, "gpu_count", lambda: 4)
    cluster = local_run.LocalCluster(str(tmp_path / "run.yaml"), run)
    cluster.start_server(0), cluster.start_server(1)
    cluster.orchestrator = local_run.Role("orchestrator", None, "http://127.0.0.1:1")
    cluster.start_trainer()
    (_, s0), (_, s1), (trainer_argv, trainer_env) = started
    assert (s0["CUDA_VISIBLE_DEVICES"], s1["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == "2,3" and "--nproc-per-node=2" in trainer_argv
    assert "GPU [0, 1]" in local_run.placement(run) and "trainer on GPU [2, 3]" in local_run.placement(run)


def test_a_cluster_run_with_local_gpus_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"local_gpus: 'dev' .*a run with an environment"):
        gpu_run(tmp_path, ONE_GPU, environment="dev")
