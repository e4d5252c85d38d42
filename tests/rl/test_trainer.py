"""Trainer pieces in one process (world of 1): training tensors aligned by hand, a GRPO step and a PPO step
(value head + GAE) that change the weights, checkpoint round trip. They run on the trainer's device: the CPU
here, the GPU where there is one (the H200 through the device tool)."""
from dataclasses import replace

import pytest
import torch
from rl_helpers import rewarded_batch, tiny_run

from moe_rl_eks.workloads.rl.trainer import (Trainer, expert_load_imbalance, resolved_backend, straggler_ratio,
                                             to_tensors)


def test_training_tensors_align_completion_tokens_logprobs_and_advantages():
    t = to_tensors([{"prompt_ids": [1, 6, 13], "completion_ids": [9, 2], "logprobs": [-0.5, -0.1], "advantage": 2.0},
                    {"prompt_ids": [1, 7], "completion_ids": [2], "logprobs": [-0.3], "advantage": -1.0}])
    # inputs = sequence[:-1], targets = sequence[1:], right-padded; completion targets start at len(prompt) - 1
    assert t.inputs.tolist() == [[1, 6, 13, 9], [1, 7, 0, 0]]
    assert t.targets.tolist() == [[6, 13, 9, 2], [7, 2, 0, 0]]
    assert t.mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert torch.allclose(t.behaviour, torch.tensor([[0, 0, -0.5, -0.1], [0, -0.3, 0, 0]]))
    assert t.advantages.tolist() == [[0, 0, 2, 2], [0, -1, 0, 0]]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_an_rl_step_moves_the_policy_toward_the_rewarded_completion(tmp_path, world_of_one, algorithm):
    run = tiny_run(tmp_path, algorithm={"name": algorithm, "kl_coef": 0.0, "entropy_coef": 0.0},
                   training={"learning_rate": 0.01})
    trainer = Trainer(run, None, rank=0, world=1)
    t = to_tensors(rewarded_batch()["samples"]).to(trainer.device)

    def logp_of_rewarded():
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(t.inputs).logits, -1)
        return float(logp[0, 4, 9])  # the first completion token of the rewarded sample
    before = logp_of_rewarded()
    metrics = trainer.rl_step(rewarded_batch())
    assert logp_of_rewarded() > before
    assert metrics["tokens"] == 4 and metrics["grad_norm"] > 0
    if algorithm == "ppo":
        assert metrics["value_loss"] > 0 and trainer.value_head.weight.grad is None  # stepped and cleared
        assert "value_head.weight" in trainer._trained_state()


def test_checkpoint_round_trip_restores_weights_optimizer_and_step(tmp_path, world_of_one):
    run = tiny_run(tmp_path, algorithm={"name": "ppo", "kl_coef": 0.0})
    trainer = Trainer(run, None, rank=0, world=1)
    trainer.rl_step(rewarded_batch())
    trainer.step = 1
    trainer.save_checkpoint()
    other = Trainer(run, None, rank=0, world=1)
    assert other.try_resume() and other.step == 1
    for a, b in zip(trainer._trained_state().values(), other._trained_state().values()):
        assert torch.equal(a, b)
    assert other.optimizer.state_dict()["state"][0]["step"] == trainer.optimizer.state_dict()["state"][0]["step"]


def test_training_with_routing_replay_reproduces_the_rollout_logprobs(tmp_path, world_of_one):
    from moe_rl_eks.workloads.rl.generation import Row, generate
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer

    run = tiny_run(tmp_path, algorithm={"routing_replay": True, "kl_coef": 0.0})
    trainer = Trainer(run, None, rank=0, world=1)
    tok = CharTokenizer()
    prompts = [tok.encode("3+4="), tok.encode("12+3=")]  # different lengths: left-padded together at rollout
    results = generate(trainer.model.eval(), [Row(p, 3, 1.0, 1.0, seed, want_routing=True)
                                              for seed, p in enumerate(prompts * 2)], tok.eos_id)
    samples = [{"prompt_ids": p, "completion_ids": r.tokens, "logprobs": r.logprobs, "routing": r.routing}
                for p, r in zip(prompts * 2, results)]
    t = to_tensors(samples).to(trainer.device)
    with torch.no_grad():
        logp = trainer._logprobs(trainer.model, t, 1.0, replay=True)[0]
    # the trainer scores each completion token exactly as the rollout sampled it, on the same experts
    assert torch.allclose(logp * t.mask, t.behaviour, atol=1e-5)
    # once the trainer's routers drift from the rollout's, replay still uses the rollout's experts; re-routing not
    with torch.no_grad():
        for layer in trainer.model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
        replayed = trainer.model(t.inputs, routing_replay=t.routing, return_routing=True, attention_mask=t.valid)
        rerouted = trainer.model(t.inputs, return_routing=True, attention_mask=t.valid)
        with_replay = trainer._logprobs(trainer.model, t, 1.0, replay=True)[0]
        without = trainer._logprobs(trainer.model, t, 1.0, replay=False)[0]
    valid = t.valid
    assert all(torch.equal(got[valid], want[valid]) for got, want in zip(replayed.routing, t.routing))
    assert any(not torch.equal(got[valid], want[valid]) for got, want in zip(rerouted.routing, t.routing))
    assert not torch.allclose(with_replay * t.mask, without * t.mask)  # the training path follows the replay


def test_straggler_ratio_is_the_slowest_arrival_over_the_median():
    assert straggler_ratio([1.0, 1.0, 1.0, 3.0]) == 3.0
    assert straggler_ratio([2.0, 1.0, 4.0]) == 2.0
    assert straggler_ratio([0.5]) == 1.0


def test_expert_load_imbalance_is_the_worst_layers_busiest_expert_over_its_mean():
    load = torch.tensor([[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 5.0]])
    assert expert_load_imbalance(load) == 2.5


def test_a_sigmoid_router_rl_step_moves_selection_biases_toward_balance(tmp_path, world_of_one):
    run = tiny_run(tmp_path, algorithm={"kl_coef": 0.0, "entropy_coef": 0.0})
    run = replace(run, model=replace(run.model, router="sigmoid"))
    trainer = Trainer(run, None, rank=0, world=1)
    gates = [layer.mlp.gate for layer in trainer.model.model.layers]
    before = [g.e_score_correction_bias.clone() for g in gates]
    step = rewarded_batch()
    step["samples"][1]["completion_ids"], step["samples"][1]["logprobs"] = [2], [-2.0]  # one padded position
    t = to_tensors(step["samples"]).to(trainer.device)
    with torch.no_grad():
        load = trainer.model(t.inputs, attention_mask=t.valid).expert_load.float()
    # padding is routed but not counted: every layer counts k slots of each real token
    assert load.sum(dim=1).tolist() == [float(t.valid.sum() * run.model.num_experts_per_tok)] * len(gates)
    metrics = trainer.rl_step(step)
    assert metrics["expert_load_imbalance"] == pytest.approx(expert_load_imbalance(load))
    rate = run.rl.training.router_bias_update_rate
    for gate, old, layer_load in zip(gates, before, load):
        # under-loaded experts gain `rate`, over-loaded ones lose it (DeepSeek-V3's balancing step)
        expected = old + rate * torch.sign(layer_load.mean() - layer_load)
        torch.testing.assert_close(gate.e_score_correction_bias, expected)
    assert any(not torch.equal(g.e_score_correction_bias, b) for g, b in zip(gates, before))


def test_the_trainer_refuses_a_backend_that_drifted_from_its_manifests(tmp_path, monkeypatch):
    run = tiny_run(tmp_path)
    monkeypatch.setenv("MOERL_EP_BACKEND", "alltoall")
    assert resolved_backend(run) == "alltoall"
    monkeypatch.setenv("MOERL_EP_BACKEND", "deepep")
    with pytest.raises(RuntimeError, match="manifests were written for 'deepep' but this run resolves to 'alltoall'"):
        resolved_backend(run)


def test_training_starts_from_a_pretrained_checkpoint_of_the_same_architecture(tmp_path, world_of_one):
    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf

    base = tiny_run(tmp_path)
    torch.manual_seed(123)  # not the run's seed: the weights must come from the checkpoint
    pretrained = MoETransformer(base.model)
    save_hf(pretrained, base.model, tmp_path / "pretrained")
    run = tiny_run(tmp_path, training={"init_from": str(tmp_path / "pretrained")})
    trainer = Trainer(run, None, rank=0, world=1)
    for name, tensor in pretrained.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name].cpu(), tensor), name
    wider = replace(run, model=replace(run.model, num_experts=8))
    with pytest.raises(ValueError, match="has num_experts=4 but the run's model.num_experts is 8"):
        Trainer(wider, None, rank=0, world=1)


def test_a_rank_starts_from_its_own_expert_slice_of_the_pretrained_or_random_weights(tmp_path):
    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.rl.trainer import initial_weights

    run = tiny_run(tmp_path)
    torch.manual_seed(5)
    random_full = initial_weights(run)
    torch.manual_seed(5)
    random_half = initial_weights(run, range(2, 4))  # rank 1 of 2: the same draw, then its slice
    pretrained = MoETransformer(run.model).state_dict()
    save_hf(pretrained, run.model, tmp_path / "pretrained")
    from_disk = initial_weights(replace(run, rl=replace(run.rl, training=replace(
        run.rl.training, init_from=str(tmp_path / "pretrained")))), range(2, 4))
    for name in pretrained:
        cut = slice(2, 4) if ".mlp.experts." in name else slice(None)
        assert torch.equal(random_half[name], random_full[name][cut]), name
        assert torch.equal(from_disk[name], pretrained[name][cut]), name
