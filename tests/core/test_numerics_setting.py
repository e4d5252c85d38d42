"""`numerics: exact` is refused at load, with the reason, wherever the rollout engine and the trainer would not
run the same batch-invariant kernels in the same order; the engine, serve-rollout and the trainer read the one
setting (RunConfig.serving_compute)."""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from moe_rl_eks.core.ep_backends import Topology, resolve_backend, resolve_decode_backend
from moe_rl_eks.core.run import RunConfig, resolve_run
from moe_rl_eks.core.schema import ConfigError, parse

TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8,
        "num_experts_per_tok": 2}


def exact(**sections) -> dict:
    return {"name": "x", "model": dict(TINY), "numerics": "exact", **sections}


@pytest.mark.parametrize("data, fragment", [
    (exact(rl={"training": {"context_parallel": 2}}), "refuses rl.training.context_parallel 2: context parallelism "
     "splits a query's keys over ranks"),
    (exact(parallelism={"ep_backend": "deepep"}), "refuses parallelism.ep_backend: deepep: DeepEP's combine adds "
     "a token's expert outputs in an order of its own"),
])
def test_exact_numerics_refuses_configurations_where_the_engine_and_trainer_cannot_share_kernels(data, fragment):
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, data, source="run.yaml")
    assert err.value.field == "numerics" and err.value.value == "exact" and fragment in str(err.value)


def test_exact_numerics_refuses_expert_rows_the_exact_expert_kernels_cannot_read():
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {**exact(), "model": {**TINY, "hidden_size": 36}}, source="run.yaml")
    assert err.value.field == "model.hidden_size" and "multiple of 8 with numerics: exact" in str(err.value)


def test_exact_numerics_takes_expert_parallelism_over_the_all_to_all_and_never_deepep():
    # the trainer's ranks and a sharded server's: the all-to-all's combine is one rank's (the bitwise tests are
    # tests/kernels/test_exact_rollout_trainer.py's)
    assert parse(RunConfig, exact(rollout={"gpus_per_server": 2}), source="run.yaml").rollout.gpus_per_server == 2
    node = Topology(nodes=1, ranks_per_node=8, device="cuda", num_experts=128)
    assert resolve_backend("auto", node)[0] == "deepep"
    backend, why = resolve_backend("auto", node, exact=True)
    assert backend == "alltoall" and why.startswith("exact numerics: the all-to-all's combine adds")
    decode, why = resolve_decode_backend(node, hidden_size=2048, top_k=8, rows_per_rank=64, deepep_importable=True,
                                         exact=True)
    assert decode == "alltoall" and "DeepEP low-latency refused: exact numerics" in why


def test_exact_numerics_resolves_several_cpu_trainer_ranks_and_refuses_a_cpu_run_without_the_interpreter(
        monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_run(parse(RunConfig, exact(), source="run.yaml"), None).ep_backend == "alltoall"
    one_rank = parse(RunConfig, exact(parallelism={"ranks_per_node": 1}), source="run.yaml")
    assert resolve_run(one_rank, None).ep_backend == "local"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="the exact kernels need CUDA GPUs"):
        resolve_run(one_rank, None)


def test_the_engine_and_the_trainers_scoring_compute_follows_the_numerics_setting():
    assert parse(RunConfig, exact(), source="run.yaml").serving_compute == "exact"
    standard = parse(RunConfig, {"name": "x", "model": dict(TINY), "moe_compute": "triton"}, source="run.yaml")
    assert standard.numerics == "standard" and standard.serving_compute == "triton"
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {**exact(), "numerics": "bitwise"}, source="run.yaml")
    assert err.value.field == "numerics" and "standard" in str(err.value) and "exact" in str(err.value)


GPU_RUN = Path(__file__).parents[2] / "configs" / "runs" / "gpu.yaml"


def quick_gpu_run(**overrides) -> RunConfig:
    """configs/runs/gpu.yaml as `make run-gpu RUN_GPU_ARGS="--quick ..."` derives it (tools/local_run.py)."""
    from moe_rl_eks.tools.local_run import quick_data, variant_data

    standard = parse(RunConfig, yaml.safe_load(GPU_RUN.read_text()), source=str(GPU_RUN))
    return parse(RunConfig, variant_data(quick_data(str(GPU_RUN), standard), **overrides), source="gpu (--quick)")


def test_the_gpu_run_loads_in_exact_mode_under_its_own_name_for_the_a_b():
    run = quick_gpu_run(numerics="exact")
    assert (run.name, run.numerics, run.serving_compute) == ("gpu-exact", "exact", "exact")
    full = parse(RunConfig, yaml.safe_load(GPU_RUN.read_text()), source=str(GPU_RUN))
    assert run.rl.training.steps == full.rl.training.steps // 4
    assert resolve_run(run, None).ep_backend == "local"  # one trainer GPU: accepted


def test_the_documented_a_b_arms_differ_only_in_numerics_and_correction_each_under_its_own_name():
    from moe_rl_eks.tools.local_run import argparser, variant_overrides

    # docs/benchmarks.md's three commands, through local-run's own parser and derivation
    section = (GPU_RUN.parents[2] / "docs" / "benchmarks.md").read_text().split("## The exact-numerics A/B")[1]
    flags = re.findall(r"`bash tools/gpu_runs/h200-run-gpu\.sh ([^`]*)`", section)
    arms = [quick_gpu_run(**variant_overrides(argparser().parse_args(["--run", str(GPU_RUN), *f.split()])))
            for f in flags]
    assert [a.name for a in arms] == ["gpu-exact-correction-none-staleness0", "gpu-correction-truncated-staleness0",
                                      "gpu-correction-none-staleness0"]
    assert [(a.numerics, a.rl.algorithm.importance_correction) for a in arms] == [
        ("exact", "none"), ("standard", "truncated"), ("standard", "none")]
    for arm in arms:
        # synchronous: nothing off-policy but the numerics (one version per sample)
        assert arm.rl.orchestrator.max_staleness == 0 and arm.weight_swap == "drain"
        same = dataclasses.replace(arm, name="gpu", numerics="standard",
                                   rl=dataclasses.replace(arm.rl, algorithm=dataclasses.replace(
                                       arm.rl.algorithm, importance_correction="truncated")))
        assert same == dataclasses.replace(arms[1], name="gpu")  # nothing else differs: seed, steps, model
        assert resolve_run(arm, None).ep_backend == "local"


def test_an_a_b_override_the_run_would_refuse_is_refused_naming_its_field():
    with pytest.raises(ConfigError) as err:
        quick_gpu_run(max_staleness=-1)
    assert (err.value.field, err.value.value) == ("rl.orchestrator.max_staleness", -1)
    with pytest.raises(ConfigError) as err:
        quick_gpu_run(importance_correction="off")
    assert err.value.field == "rl.algorithm.importance_correction" and "'truncated', 'none'" in str(err.value)


def test_the_run_summary_averages_the_mismatch_over_the_rl_steps_that_report_it():
    from moe_rl_eks.tools.local_run import mismatch_summary

    rows = [{"logprob_bitwise_equal": 1.0, "logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0,
             "logprob_kl_rollout_trainer": 0.0, "logprob_kl_trainer_rollout": 0.0},  # a critic warm-up step
            {"logprob_bitwise_equal": 0.5, "logprob_abs_diff_mean": 0.25, "logprob_abs_diff_max": 0.75,
             "logprob_kl_rollout_trainer": 0.125, "logprob_kl_trainer_rollout": 0.5,
             "importance_weight_mean": 1.5, "importance_truncated_fraction": 0.25}]
    assert mismatch_summary(rows) == {"logprob_bitwise_equal": 0.75, "logprob_abs_diff_mean": 0.125,
                                      "logprob_kl_rollout_trainer": 0.0625, "logprob_kl_trainer_rollout": 0.25,
                                      "importance_weight_mean": 1.5, "importance_truncated_fraction": 0.25,
                                      "logprob_abs_diff_max": 0.75}
    assert mismatch_summary([]) == {}
