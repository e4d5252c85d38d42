"""Routers, balance loss, load statistics and the torch compute backend against hand-computed cases."""

import pytest
import torch

from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.backends import get_compute
from moe_rl_eks.workloads.moe.compute import RoutingSpec
from moe_rl_eks.workloads.moe.router import (balance_bias_step, expert_load, load_balancing_loss, node_limit_bias, select_experts,
                                             weights_for)
from moe_rl_eks.workloads.moe.torch_compute import TorchCompute


def logit(p):
    p = torch.tensor(p, dtype=torch.float32)
    return torch.log(p / (1 - p))


def test_softmax_top_k_with_and_without_renormalisation():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    weights, ids = select_experts(logits, RoutingSpec(top_k=2, scoring="softmax"), None)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))
    weights, _ = select_experts(logits, RoutingSpec(top_k=2, scoring="softmax", renormalize=False), None)
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.3]]))


SCORES = [[0.9, 0.1, 0.6, 0.6, 0.8, 0.7, 0.2, 0.3]]  # 4 groups of 2: sums 1.0, 1.2, 1.5, 0.5; maxima .9 .6 .8 .3


def test_group_limited_selection_skips_the_best_expert_outside_the_best_groups():
    spec = RoutingSpec(top_k=2, scoring="sigmoid", n_group=4, topk_group=2, scaling=2.5)
    weights, ids = select_experts(logit(SCORES), spec, None)
    assert ids.tolist() == [[4, 5]]  # groups 2 and 1 win; expert 0 (0.9) sits in group 0
    torch.testing.assert_close(weights, torch.tensor([[0.8 / 1.5 * 2.5, 0.7 / 1.5 * 2.5]]))


def test_bias_changes_selection_but_not_weights():
    spec = RoutingSpec(top_k=2, scoring="sigmoid")
    logits = logit([[0.5, 0.6, 0.7, 0.4]])
    _, unbiased = select_experts(logits, spec, None)
    weights, ids = select_experts(logits, spec, torch.tensor([0.3, 0.0, 0.0, 0.0]))
    assert unbiased.tolist() == [[2, 1]] and ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5 / 1.2, 0.7 / 1.2]]))


def test_node_limit_scores_nodes_by_their_top_k_over_m_experts():
    spec = RoutingSpec(top_k=2, scoring="sigmoid")
    one_node = node_limit_bias(logit(SCORES), spec, None, node_groups=4, max_nodes=1)
    assert select_experts(logit(SCORES), spec, one_node)[1].tolist() == [[4, 5]]  # node 2: 0.8 + 0.7
    two_nodes = node_limit_bias(logit(SCORES), spec, None, node_groups=4, max_nodes=2)
    assert select_experts(logit(SCORES), spec, two_nodes)[1].tolist() == [[0, 4]]  # nodes by max: 0 and 2


def test_node_limit_is_honoured_by_every_token_of_the_model(tiny_config):
    config = tiny_config(num_experts=16, num_experts_per_tok=4, max_nodes_per_token=2, expert_node_groups=4)
    out = MoETransformer(config)(torch.randint(0, 96, (4, 16)), return_routing=True)
    for ids in out.routing:
        nodes_per_token = [len(set(row)) for row in (ids // 4).reshape(-1, 4).tolist()]
        assert max(nodes_per_token) <= 2
    unlimited = MoETransformer(tiny_config(num_experts=16, num_experts_per_tok=4))
    unlimited.load_state_dict(MoETransformer(config).state_dict())
    ids = unlimited(torch.randint(0, 96, (4, 16)), return_routing=True).routing[0]
    assert max(len(set(row)) for row in (ids // 4).reshape(-1, 4).tolist()) > 2  # the limit is what bounds it


def test_node_limit_config_errors_name_the_field(tiny_config):
    with pytest.raises(ConfigError, match="max_nodes_per_token: 1 is not allowed; the allowed nodes hold fewer"):
        MoETransformer(tiny_config(num_experts=8, num_experts_per_tok=4, max_nodes_per_token=1, expert_node_groups=4))
    with pytest.raises(ConfigError, match="expert_node_groups: 3 .* must divide num_experts"):
        MoETransformer(tiny_config(max_nodes_per_token=1, expert_node_groups=3))


def test_replayed_weights_follow_the_given_ids_with_gradient():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).requires_grad_()
    spec = RoutingSpec(top_k=2, scoring="softmax")
    weights = weights_for(logits.softmax(-1), torch.tensor([[0, 1]]), spec)
    torch.testing.assert_close(weights, torch.tensor([[1 / 3, 2 / 3]]))
    weights[0, 0].backward()
    assert logits.grad.abs().sum() > 0


def test_balance_loss_and_expert_load_by_hand():
    spec = RoutingSpec(top_k=1, scoring="softmax")
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    ids = torch.tensor([[0], [0]])
    assert load_balancing_loss(scores, ids, spec).item() == pytest.approx(2 * 0.75)  # f = [1, 0]
    balanced = torch.tensor([[0], [1]])
    assert load_balancing_loss(torch.full((2, 2), 0.5), balanced, spec).item() == pytest.approx(1.0)
    assert expert_load(torch.tensor([[0, 3], [3, 1]]), 5).tolist() == [1, 1, 0, 2, 0]


def test_torch_experts_match_a_per_token_reference_with_empty_experts():
    compute = TorchCompute()
    t, k, e, h, width = 6, 2, 5, 8, 4
    x = torch.randn(t, h)
    ids = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 4], [0, 4], [4, 3]])  # experts 1 and 2 get nothing
    weights = torch.rand(t, k)
    w13, w2 = torch.randn(e, 2 * width, h), torch.randn(e, h, width)
    x_sorted, counts, handle = compute.permute(x, ids, e)
    assert counts.tolist() == [4, 0, 0, 5, 3]
    out = compute.unpermute(compute.experts(x_sorted, counts, w13, w2), weights, handle)

    def expert(j, v):
        g, u = (w13[j] @ v).split(width)
        return w2[j] @ (torch.nn.functional.silu(g) * u)

    expected = torch.stack([sum(weights[i, s] * expert(ids[i, s], x[i]) for s in range(k)) for i in range(t)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_unknown_compute_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'cuda' is not known; allowed: torch, triton, exact"):
        get_compute("cuda")
    assert get_compute("torch").name == "torch"
    assert type(get_compute("triton")).__name__ == "TritonCompute"  # kernels' backend, imported on demand
    assert type(get_compute("exact")).__name__ == "ExactCompute"


def test_balance_bias_step_raises_underloaded_and_lowers_overloaded_experts(tiny_config):
    step = balance_bias_step(torch.tensor([0.0, 0.5, -0.5]), torch.tensor([3.0, 1.0, 2.0]), rate=0.1)
    torch.testing.assert_close(step, torch.tensor([-0.1, 0.6, -0.5]))
    model = MoETransformer(tiny_config(router="sigmoid"))
    load = model(torch.randint(0, 96, (2, 8))).expert_load
    model.update_routing_bias(load, rate=0.01)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(bias, 0.01 * torch.sign(load[1].mean() - load[1]))
    with pytest.raises(ValueError, match="need router: sigmoid"):
        MoETransformer(tiny_config()).update_routing_bias(load)
