"""The trainer-at-scale planner (core/planner.py, `moerl plan`): its counts against published facts, its node
counts against the issue's targets, and the refusal of a cluster run whose trainer does not fit."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from moe_rl_eks.core import planner
from moe_rl_eks.core.catalog import instance_type
from moe_rl_eks.core.hf_config import hf_config
from moe_rl_eks.core.models import known_model
from moe_rl_eks.core.run import ParallelismConfig, RolloutConfig, RunConfig, resolve_run
from moe_rl_eks.core.schema import ConfigError
from test_run_resolution import CLUSTER_READY, ENVS, TINY

P5EN, P5 = instance_type("p5en.48xlarge"), instance_type("p5.48xlarge")


@pytest.mark.parametrize("name, total, dense", [("qwen3-30b-a3b", 30.5e9, 1.54e9), ("qwen3-235b-a22b", 235.1e9, 8.0e9)])
def test_the_known_models_have_their_published_parameter_counts(name, total, dense):
    m = known_model(name)
    assert m.parameter_count() == pytest.approx(total, rel=2e-3)
    assert m.parameter_count() - m.routed_expert_parameter_count() == pytest.approx(dense, rel=5e-3)


def test_qwen3_235b_trains_on_eight_p5en_nodes_at_8k_token_microbatches_and_not_on_four():
    m = known_model("qwen3-235b-a22b")
    smallest = planner.smallest_fit(m, P5EN)
    assert smallest is not None and smallest.nodes == 8 and smallest.fits
    assert not planner.plan(m, P5EN, 4).fits  # within 5 % of the GPU at 4 nodes: the plan keeps that headroom


def test_qwen3_30b_trains_on_one_p5en_node_and_more_nodes_hold_less_per_gpu():
    m = known_model("qwen3-30b-a3b")
    assert planner.smallest_fit(m, P5EN).nodes == 1
    one, four = planner.plan(m, P5EN, 1).memory, planner.plan(m, P5EN, 4).memory
    assert four.parameters < one.parameters and four.activations == one.activations


def test_node_counts_whose_ranks_do_not_split_the_experts_evenly_are_skipped():
    m = replace(known_model("qwen3-235b-a22b"), num_experts=120)  # 8 GPUs a node: 3 and 5 nodes split 120, 4 not
    shape = planner.TrainingShape(microbatch_tokens=2048)
    smallest = planner.smallest_fit(m, P5EN, shape=shape)
    assert smallest.nodes == 5 and planner.plan(m, P5EN, 4, shape=shape).fits  # 4 would hold it; 120 / 32 no split
    assert not planner.plan(m, P5EN, 3, shape=shape).fits


def test_the_flop_count_matches_megatron_bridges_published_qwen3_30b_figure():
    # 299 TFLOP/s per H100 at 20.15 s per step on 16 GPUs, global batch 1,024 x 4,096 tokens (REFERENCE.md):
    # 23.0 GFLOP per token as Megatron counts a step without recomputation.
    published = 299e12 * 20.15 * 16 / (1024 * 4096)
    ours = planner.training_flops_per_token(known_model("qwen3-30b-a3b"), 4096, "off")
    assert ours == pytest.approx(published, rel=0.03)


def test_deepep_sends_a_token_once_per_node_over_efa_and_alltoall_once_per_expert():
    m = known_model("qwen3-30b-a3b")
    _, alltoall = planner.expert_traffic_bytes_per_token(m, 4, 8, "alltoall", "full")
    _, deepep = planner.expert_traffic_bytes_per_token(m, 4, 8, "deepep", "full")
    row = 2 * m.hidden_size * 6  # bf16 rows, dispatch + combine in the forward, backward and recompute
    assert alltoall == pytest.approx(8 * 3 / 4 * row)
    assert deepep == pytest.approx(3 * (1 - 0.75 ** 8) * row)
    assert planner.expert_traffic_bytes_per_token(m, 1, 8, "deepep", "full")[1] == 0


def test_a_cluster_run_whose_trainer_does_not_fit_its_gpus_is_refused_naming_the_numbers():
    run = RunConfig(name="big", model=known_model("qwen3-235b-a22b"), environment="prod",
                    parallelism=ParallelismConfig(trainer_nodes=2), rollout=RolloutConfig(gpus_per_server=8),
                    **CLUSTER_READY)
    with pytest.raises(ConfigError) as err:
        resolve_run(run, ENVS["prod"])
    assert err.value.field == "parallelism.trainer_nodes" and err.value.value == 2
    assert "GiB" in str(err.value) and "moerl plan" in str(err.value)


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "moe_rl_eks.tools.cli", "plan", *args], capture_output=True,
                          text=True, timeout=60)


def test_moerl_plan_prints_the_smallest_trainer_and_both_backends_without_torch(tmp_path):
    out = run_plan("--model", "qwen3-235b-a22b", "--nodes", "4")
    assert out.returncode == 1, out.stderr  # 4 nodes asked for: they do not fit
    assert "smallest trainer that fits: 8 x p5en.48xlarge" in out.stdout
    assert "with alltoall" in out.stdout and "with deepep" in out.stdout and "| 4 | 32 |" in out.stdout
    code = ("import sys; from moe_rl_eks.tools.plan import main; main(['--model', 'qwen3-30b-a3b']); "
            "print('torch' in sys.modules)")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip().endswith("False"), probe.stdout + probe.stderr


def test_moerl_plan_reads_a_checkpoint_directorys_config_and_names_a_bad_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TINY)))
    out = run_plan("--model", str(tmp_path), "--instance-type", "p5.48xlarge")
    assert out.returncode == 0, out.stderr
    assert "smallest trainer that fits: 1 x p5.48xlarge" in out.stdout
    bad = run_plan("--model", "qwen4-1t")
    assert bad.returncode == 2 and "qwen4-1t" in bad.stderr and "qwen3-235b-a22b" in bad.stderr


def test_ep_over_part_of_the_ranks_holds_the_same_state_moves_no_expert_traffic_over_efa_and_pays_fsdp():
    # 235B on 8 p5en nodes: EP within each node, the experts' 8 copies sharded over the nodes
    m, whole, grouped = known_model("qwen3-235b-a22b"), planner.TrainingShape(), \
        planner.TrainingShape(expert_parallel=8)
    a, b = planner.plan(m, P5EN, 8, shape=whole), planner.plan(m, P5EN, 8, shape=grouped)
    assert (b.memory.parameters, b.memory.optimizer) == (a.memory.parameters, a.memory.optimizer)  # 1/64 each
    per_layer = m.routed_expert_parameter_count() // (m.num_hidden_layers * 8)  # an EP rank's experts of a layer
    assert b.memory.gathered - a.memory.gathered == (2 * 4 + 4) * per_layer  # two gathered, one gradient
    assert a.step.efa_s > 0 and b.step.efa_s == 0 and b.step.fsdp_s > a.step.fsdp_s > 0
    with pytest.raises(ValueError, match="needs fsdp"):
        planner.plan(m, P5EN, 8, shape=replace(grouped, fsdp=False))
    with pytest.raises(ValueError, match="divide the 64 trainer ranks"):
        planner.plan(m, P5EN, 8, shape=replace(grouped, expert_parallel=24))


def test_bf16_gathers_halve_fsdps_gathered_weights_and_traffic_and_the_kept_residual_stream():
    m = known_model("qwen3-235b-a22b")
    fp32 = planner.plan(m, P5EN, 8)
    bf16 = planner.plan(m, P5EN, 8, shape=planner.TrainingShape(param_dtype="bfloat16"))
    assert bf16.memory.parameters == fp32.memory.parameters  # the float32 master shards stay
    p = planner.sharded_parameters(m, 64, planner.TrainingShape())
    assert fp32.memory.gathered - bf16.memory.gathered == 2 * (p.root + 2 * p.dense_layer)
    assert bf16.step.fsdp_s == pytest.approx(fp32.step.fsdp_s * (2 * 2 + 4) / (2 * 4 + 4))
    kept = planner.TrainingShape().microbatch_tokens * m.num_hidden_layers * 2 * m.hidden_size
    assert fp32.memory.activations - bf16.memory.activations == kept


def test_context_parallel_trains_a_sample_about_n_times_longer_at_the_same_activations_per_gpu():
    m = known_model("qwen3-30b-a3b")
    alone = planner.longest_sample(m, P5EN, 1)
    split = planner.longest_sample(m, P5EN, 1, shape=planner.TrainingShape(context_parallel=4))
    assert alone.fits and split.fits and alone.step.nvlink_s < split.step.nvlink_s  # Ulysses' all-to-alls
    # about 4x: the logits chunk and the state do not grow with the sample
    assert 3.5 * alone.shape.microbatch_tokens < split.shape.microbatch_tokens < 4.1 * alone.shape.microbatch_tokens
    assert split.memory.activations == pytest.approx(alone.memory.activations, rel=0.02)
    longer = replace(split.shape, microbatch_tokens=split.shape.microbatch_tokens + 1024)
    assert not planner.plan(m, P5EN, 1, shape=longer).fits  # the longest, to the 1,024-token granule
    assert planner.ulysses_bytes_per_token(m, 1, "full") == 0


def test_moerl_plan_prints_the_longest_sample_with_and_without_context_parallelism():
    out = run_plan("--model", "qwen3-30b-a3b", "--context-parallel", "4", "--expert-parallel", "4",
                   "--fsdp-param-dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    line = next(text for text in out.stdout.splitlines() if text.startswith("longest sample on 1 node(s)"))
    alone = planner.longest_sample(known_model("qwen3-30b-a3b"), P5EN, 1, shape=planner.TrainingShape(
        expert_parallel=4, param_dtype="bfloat16"))
    assert f"CP 1: {alone.shape.microbatch_tokens:,} tokens" in line and "; CP 4: " in line
    assert "EP groups of 4 ranks" in out.stdout and "bfloat16 gathers" in out.stdout
