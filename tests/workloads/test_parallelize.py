"""The parallelization seam (model/parallelize.py) against the model's own expert-parallel construction, and the
plans it refuses."""
import pytest
import torch

from ep_ranks import CONFIG, parallelized_against_constructed, run_ranks
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import ParallelPlan, check_layout, parallelize


def test_the_default_plan_over_two_ranks_is_the_constructed_ep_model_bitwise():
    result = run_ranks(2, parallelized_against_constructed)
    assert result["expert_shape"] == (4, 2 * CONFIG.moe_intermediate_size, CONFIG.hidden_size)  # half the experts
    assert "loss" in result["names"] and "model.layers.1.mlp.experts.down_proj" in result["names"]
    assert result["differ"] == []  # loss and every gradient, on both ranks


@pytest.mark.parametrize("plan, message", [
    (ParallelPlan(ep_degree=2), "ep_degree 2 on a mesh of 1 ranks: EP must span every rank or a divisor of them"),
    (ParallelPlan(compute="triton"), "built with compute 'torch', the plan says 'triton'"),
])
def test_a_plan_the_mesh_or_the_model_cannot_take_is_refused_naming_it(plan, message):
    with torch.device("meta"):
        model = MoETransformer(CONFIG)
    with pytest.raises(ValueError, match=message):
        parallelize(model, None, plan)


@pytest.mark.parametrize("plan, ranks, experts, message", [
    (ParallelPlan(ep_degree=2), 4, 8, r"ep_degree 2 < 4 ranks shards the experts' copies with FSDP: turn fsdp on"),
    (ParallelPlan(ep_degree=3, fsdp=True), 6, 6, None),
    (ParallelPlan(ep_degree=4, fsdp=True), 6, 12, "EP must span every rank or a divisor of them >= 2"),
    (ParallelPlan(ep_degree=2, fsdp=True), 4, 6, "the 6 experts must split evenly over all 4 ranks"),
    (ParallelPlan(ep_degree=2, fsdp=True, cp_degree=3), 4, 8, "cp_degree 3 must divide the 4 ranks"),
])
def test_ep_over_part_of_the_ranks_is_refused_unless_fsdp_shards_even_copies(plan, ranks, experts, message):
    if message is None:
        check_layout(plan, ranks, experts)  # EP 3 x 2 copies of 6 experts: one a rank
    else:
        with pytest.raises(ValueError, match=message):
            check_layout(plan, ranks, experts)


def test_an_unknown_checkpointing_mode_is_refused_when_the_plan_is_made():
    with pytest.raises(ValueError, match="activation_checkpointing 'some' is not one of"):
        ParallelPlan(activation_checkpointing="some")
