"""`numerics: exact` is refused at load, with the reason, wherever the rollout engine and the trainer would not
run the same batch-invariant kernels in the same order; the engine, serve-rollout and the trainer read the one
setting (RunConfig.serving_compute)."""
import pytest

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
    (exact(parallelism={"ep_backend": "deepep"}), "refuses parallelism.ep_backend: deepep: DeepEP's combine"),
    (exact(rollout={"gpus_per_server": 2}), "refuses rollout.gpus_per_server 2: a sharded server combines"),
])
def test_exact_numerics_refuses_configurations_where_the_engine_and_trainer_cannot_share_kernels(data, fragment):
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, data, source="run.yaml")
    assert err.value.field == "numerics" and err.value.value == "exact" and fragment in str(err.value)


def test_exact_numerics_refuses_expert_rows_the_exact_expert_kernels_cannot_read():
    with pytest.raises(ConfigError) as err:
        parse(RunConfig, {**exact(), "model": {**TINY, "hidden_size": 36}}, source="run.yaml")
    assert err.value.field == "model.hidden_size" and "multiple of 8 with numerics: exact" in str(err.value)


def test_exact_numerics_refuses_several_trainer_ranks_and_a_cpu_run_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="refuses 2 trainer ranks: the trainer's exact logprob forward runs on one"):
        resolve_run(parse(RunConfig, exact(), source="run.yaml"), None)
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


def test_the_gpu_run_loads_in_exact_mode_under_its_own_name_for_the_a_b():
    from pathlib import Path

    import yaml

    from moe_rl_eks.tools.local_run import numerics_data, quick_data

    path = Path(__file__).parents[2] / "configs" / "runs" / "gpu.yaml"
    standard = parse(RunConfig, yaml.safe_load(path.read_text()), source=str(path))
    run = parse(RunConfig, numerics_data(quick_data(str(path), standard), "exact"), source="gpu (--quick)")
    assert (run.name, run.numerics, run.serving_compute) == ("gpu-exact", "exact", "exact")
    assert run.rl.training.steps == standard.rl.training.steps // 4
    assert resolve_run(run, None).ep_backend == "local"  # one trainer GPU: accepted
