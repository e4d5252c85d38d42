"""The torch-free memory model (core/memory.py, which the planner `moerl plan` uses) against the trainer's FSDP
layout itself, built per rank on the meta device: Qwen3-30B-A3B's and Qwen3-235B-A22B's layer shapes at 2 layers
(the per-layer sizes that decide the sharding)."""
from dataclasses import replace

import pytest

from ep_ranks import run_ranks, sharded_state_bytes
from moe_rl_eks.core import memory
from moe_rl_eks.core.models import known_model


@pytest.mark.parametrize("name, world", [("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 4), ("qwen3-235b-a22b", 4)])
def test_the_memory_model_holds_the_fsdp_ranks_parameter_gradient_and_adamw_bytes_within_one_percent(name, world):
    config = replace(known_model(name), num_hidden_layers=2)
    experts = config.routed_expert_parameter_count()
    model = memory.trainer_state(replicated=config.parameter_count() - experts, experts=experts, ranks=world,
                                 fsdp=True)
    measured = run_ranks(world, sharded_state_bytes, config)  # rank 0's
    for kind, real in measured.items():
        assert getattr(model, kind) == pytest.approx(real, rel=0.01), kind
    # what FSDP took off each rank is (1 - 1 / world) of the dense weights: the expert split alone would not
    dense_bytes = (config.parameter_count() - experts) * 4
    replicated = memory.trainer_state(replicated=config.parameter_count() - experts, experts=experts, ranks=world,
                                      fsdp=False)
    saved = replicated.parameter_bytes - measured["parameter_bytes"]
    assert saved == pytest.approx(dense_bytes * (1 - 1 / world), rel=0.01)
