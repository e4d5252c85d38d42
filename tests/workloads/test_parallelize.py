"""The parallelization seam (model/parallelize.py) against the model's own expert-parallel construction, and the
plans it refuses."""
import pytest
import torch

from ep_ranks import CONFIG, parallelized_against_constructed, run_ranks
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import ParallelPlan, parallelize


def test_the_default_plan_over_two_ranks_is_the_constructed_ep_model_bitwise():
    result = run_ranks(2, parallelized_against_constructed)
    assert result["expert_shape"] == (4, 2 * CONFIG.moe_intermediate_size, CONFIG.hidden_size)  # half the experts
    assert "loss" in result["names"] and "model.layers.1.mlp.experts.down_proj" in result["names"]
    assert result["differ"] == []  # loss and every gradient, on both ranks


@pytest.mark.parametrize("plan, message", [
    (ParallelPlan(ep_degree=2), "ep_degree 2 on a mesh of 1 ranks: only experts split over every rank is built; "
                                "use ep_degree 1"),
    (ParallelPlan(compute="triton"), "built with compute 'torch', the plan says 'triton'"),
])
def test_a_plan_the_mesh_or_the_model_cannot_take_is_refused_naming_it(plan, message):
    with torch.device("meta"):
        model = MoETransformer(CONFIG)
    with pytest.raises(ValueError, match=message):
        parallelize(model, None, plan)


def test_an_unknown_checkpointing_mode_is_refused_when_the_plan_is_made():
    with pytest.raises(ValueError, match="activation_checkpointing 'some' is not one of"):
        ParallelPlan(activation_checkpointing="some")
