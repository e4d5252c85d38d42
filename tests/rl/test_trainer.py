"""Trainer pieces in one process (world of 1) and in gloo ranks: training tensors aligned by hand, micro-batch
plans, RL steps that change the weights, gradients independent of how the batch is split (micro-batches,
checkpointing, ranks, a rank with no samples), mini-batches that make the clip bite, the learning-rate schedule,
SIGTERM on one rank, checkpoint round trip. They run on the trainer's device: the CPU here, the GPU where there is
one (the H200 through the device tool)."""
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from rl_helpers import rewarded_batch, tiny_run, write_run
from trainer_ranks import (ep_step_gradients, full_state, loop_resumed, loop_stopped_on_rank_1, resumed_state,
                           run_ranks, step_gradients, train_and_checkpoint, trained_then_resumed)

from moe_rl_eks.core.run import load_run
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.workloads.trainer.microbatch import Sequences, plan_microbatches, rank_shares, sequence_tokens
from moe_rl_eks.workloads.rl.protocol import (CHECKPOINT_FORMAT, Batch, BatchStats, TrainingSample, VersionRef,
                                              one_version)
from moe_rl_eks.workloads.rl.routing_store import RoutingStore
from moe_rl_eks.workloads.trainer.checkpoint import CheckpointFormatError
from moe_rl_eks.workloads.rl.runtime import output_dir
from moe_rl_eks.workloads.trainer.step import learning_rate
from moe_rl_eks.workloads.trainer.loop import (Trainer, expert_load_imbalance, init_trainer_process_group,
                                               resolved_backend, straggler_ratio)
from moe_rl_eks.workloads.rl.weights import open_store

FAST = {"kl_coef": 0.0, "entropy_coef": 0.0}


def sample(i, prompt, completion, advantage=0.0, reward=0.0, logprobs=None, routing=None):
    return TrainingSample(f"p{i}/0", prompt, completion, logprobs or [-1.0] * len(completion), reward, advantage,
                          True, one_version(VersionRef(0, 0), len(completion)), routing)


def varied_batch(step: int = 0) -> Batch:
    """Four samples of different lengths and signs of advantage."""
    samples = [sample(0, [1, 6, 13, 6, 16], [9, 2], 1.0, 1.0), sample(1, [1, 6, 13, 6, 16], [10, 11, 2], -1.0),
               sample(2, [1, 7, 13], [5, 6, 7, 8, 2], 0.5, 1.0), sample(3, [1, 8, 13, 9], [2], -0.5)]
    return Batch(step, 0, samples, BatchStats(0.0, 0.5, 0.0, 0, 0, 0, 0, 4))


def test_training_sequences_align_completion_tokens_logprobs_and_advantages():
    t = Sequences.of([sample(0, [1, 6, 13], [9, 2], 2.0, logprobs=[-0.5, -0.1]),
                      sample(1, [1, 7], [2], -1.0, logprobs=[-0.3])])
    # inputs = sequence[:-1], targets = sequence[1:], right-padded; completion targets start at len(prompt) - 1
    assert t.inputs.tolist() == [[1, 6, 13, 9], [1, 7, 0, 0]]
    assert t.targets.tolist() == [[6, 13, 9, 2], [7, 2, 0, 0]]
    assert t.mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert torch.allclose(t.behaviour, torch.tensor([[0, 0, -0.5, -0.1], [0, -0.3, 0, 0]]))
    assert t.advantages.tolist() == [2.0, -1.0] and t.lengths == [4, 2]
    # the model's packed row is the real tokens back to back; unpack puts per-token values back in place
    assert t.packed_inputs().tolist() == [[1, 6, 13, 9, 1, 7]]
    assert t.unpack(torch.arange(1.0, 7.0)).tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert t.select([1]).inputs.tolist() == [[1, 7]]  # trimmed to its longest row


def test_routing_replay_ids_land_on_their_positions_in_the_packed_row(tmp_path):
    store = RoutingStore(tmp_path)
    ids = torch.arange(4 * 2 * 2).view(4, 2, 2) % 4  # [prompt + completion - 1 positions, layers, k]
    ref = store.write("r0", ids.numpy(), num_experts=4)
    t = Sequences.of([sample(0, [1, 6, 13], [9, 2], routing=ref)], store.read)
    packed = t.packed_routing()
    assert len(packed) == 2 and all(torch.equal(packed[layer][0], ids[:, layer]) for layer in range(2))
    assert Sequences.of([sample(0, [1, 6, 13], [9, 2], routing=ref)]).routing is None  # no replay: nothing read
    with pytest.raises(ValueError, match="routing covers 4 positions; prompt \\+ completion - 1 is 3"):
        Sequences.of([sample(0, [1, 6], [9, 2], routing=ref)], store.read)


def test_micro_batch_plans_fill_the_token_budget_longest_first_and_refuse_longer_samples():
    plan = plan_microbatches([5, 3, 8, 2, 6], 10)
    assert plan == [[2, 3], [1, 4], [0]]  # 8+2, 6+3, 5: each within 10, three instead of five
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2, 3, 4]
    assert plan_microbatches([], 10) == []
    with pytest.raises(ValueError, match="a sample of 11 tokens exceeds rl.training.max_tokens_per_microbatch \\(10\\)"):
        plan_microbatches([3, 11], 10)


def test_rank_shares_balance_tokens_not_sample_counts():
    counts = [100, 90, 80, 10, 10, 10]
    shares = rank_shares(counts, 2)
    # every other sample would give 190 and 110 tokens; the greedy split 130 and 170 (the best possible here)
    assert shares == [[0, 3, 4, 5], [1, 2]]
    assert [sum(counts[i] for i in share) for share in shares] == [130, 170]
    assert rank_shares(counts, 2) == shares  # every rank computes the same split
    # ties go to the rank with fewer samples, then the lower rank; a rank may get nothing
    assert rank_shares([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert rank_shares([7, 3], 3) == [[0], [1], []]
    assert rank_shares([], 2) == [[], []]
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        rank_shares([1], 0)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_an_rl_step_moves_the_policy_toward_the_rewarded_completion(tmp_path, world_of_one, algorithm):
    run = tiny_run(tmp_path, algorithm={"name": algorithm, **FAST}, training={"learning_rate": 0.01})
    trainer = Trainer(run, None, rank=0, world=1)
    t = Sequences.of(rewarded_batch().samples).to(trainer.device)

    def logp_of_rewarded():
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(t.inputs).logits, -1)
        return float(logp[0, 4, 9])  # the first completion token of the rewarded sample
    before = logp_of_rewarded()
    metrics = trainer.rl_step(rewarded_batch())
    assert logp_of_rewarded() > before
    assert metrics["tokens"] == 4 and metrics["grad_norm"] > 0 and metrics["optimizer_steps"] == 1
    if algorithm == "ppo":
        assert metrics["value_loss"] > 0 and trainer.critic.net[0].weight.grad is None  # stepped and cleared
        assert "critic.net.0.weight" in trainer._trained_state()


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "gspo", "ppo"])
def test_micro_batches_and_checkpointing_give_the_gradient_of_one_big_batch(tmp_path, world_of_one, algorithm):
    results = []
    for budget, checkpointing in ((4096, "off"), (9, "save_attention")):  # one micro-batch vs three
        run = tiny_run(tmp_path, algorithm={"name": algorithm, "kl_coef": 0.05, "entropy_coef": 0.01},
                       training={"max_tokens_per_microbatch": budget, "activation_checkpointing": checkpointing},
                       sampling={"max_prompt_tokens": 4, "max_tokens": 6})
        trainer = Trainer(run, None, rank=0, world=1)
        trainer.reference = Trainer(run, None, rank=0, world=1).model.requires_grad_(False)
        with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
            for p in trainer.reference.parameters():
                p.add_(0.01 * torch.randn_like(p))
        counted = []
        forward = trainer.train_step.forward
        trainer.train_step.forward = lambda *a, **k: counted.append(1) or forward(*a, **k)
        results.append((*step_gradients(trainer, varied_batch()), len(counted)))
    (want, want_metrics, one), (got, got_metrics, split) = results
    assert split > one  # more forwards: the budget split the batch
    assert want.keys() == got.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for key in ("loss", "kl", "entropy", "clip_fraction"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key


def test_each_trainer_rank_reads_the_routing_of_its_own_samples_only(tmp_path):
    from trainer_ranks import routing_read_by_rank

    path = write_run(tmp_path, algorithm={**FAST, "routing_replay": True})
    run = load_run(path)
    store = RoutingStore.of(run)
    batch = varied_batch()
    cfg = run.model
    samples = [replace(s, routing=store.write(
        f"r{i}", torch.randint(0, cfg.num_experts, (sequence_tokens(s), cfg.num_hidden_layers,
                                                    cfg.num_experts_per_tok)).numpy(), cfg.num_experts))
        for i, s in enumerate(batch.samples)]
    batch = replace(batch, samples=samples)
    ranks = run_ranks(2, routing_read_by_rank, str(path), batch.to_json())
    shares = rank_shares([sequence_tokens(s) for s in samples], 2)
    assert [r["read"] for r in ranks] == [sorted(samples[i].routing.key for i in share) for share in shares]
    assert [r["bytes_read"] for r in ranks] == [sum(samples[i].routing.bytes for i in share) for share in shares]
    assert all(share for share in shares)  # both ranks read something, and nothing of the other's


def test_ep_ranks_with_one_rank_empty_give_the_gradient_of_one_rank(tmp_path):
    # Two samples on two ranks, and one sample on two ranks (rank 1 has none: it runs empty micro-batches so the
    # EP collectives still pair up); each must equal one process training the same batch.
    path = write_run(tmp_path, algorithm=FAST, training={"max_tokens_per_microbatch": 600})
    run = tiny_run(tmp_path, algorithm=FAST, training={"max_tokens_per_microbatch": 600})
    for batch in (varied_batch(), Batch(0, 0, varied_batch().samples[2:3], varied_batch().stats)):
        want, want_metrics = step_gradients(Trainer(run, None, rank=0, world=1), batch)
        ranks = run_ranks(2, ep_step_gradients, str(path), batch.to_json())
        shares = rank_shares([sequence_tokens(s) for s in batch.samples], 2)
        assert [r["samples"] for r in ranks] == [sorted(batch.samples[i].id for i in share) for share in shares]
        for r in ranks:
            assert r["metrics"]["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)
            for name, grad in want.items():
                torch.testing.assert_close(r["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_mini_batches_step_several_times_per_batch_and_make_the_clip_bite(tmp_path, world_of_one):
    clip = {}
    for mini_batches in (1, 2):
        run = tiny_run(tmp_path, algorithm={"name": "ppo", "mini_batches": mini_batches, **FAST},
                       training={"learning_rate": 0.05})
        metrics = Trainer(run, None, rank=0, world=1).rl_step(rewarded_batch())
        assert metrics["optimizer_steps"] == mini_batches
        clip[mini_batches] = metrics["clip_fraction"]
    # one step per batch: the ratio to the batch's starting policy is 1 and nothing is clipped; with two, the
    # second mini-batch is scored against the policy before the first step and its ratio leaves the trust region
    assert clip[1] == 0.0 and clip[2] > 0.0


def test_learning_rate_warms_up_linearly_then_stays_or_follows_a_cosine(tmp_path):
    constant = tiny_run(tmp_path, training={"learning_rate": 0.1, "lr_warmup_steps": 4}).rl.training
    assert [learning_rate(constant, i, 10) for i in range(6)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    cosine = replace(constant, lr_schedule="cosine", min_learning_rate=0.01)
    rates = [learning_rate(cosine, i, 10) for i in range(10)]
    assert rates[3] == pytest.approx(0.1) and rates[-1] == pytest.approx(0.01)
    assert rates[6] == pytest.approx(0.01 + 0.09 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 2 / 5)).item()))
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))
    # the trainer steps with the schedule's rate at its optimizer step (steps x epochs x mini-batches)
    run = tiny_run(tmp_path, algorithm={"mini_batches": 2, **FAST}, training={"learning_rate": 0.1, "lr_warmup_steps": 4})
    trainer = Trainer(run, None, rank=0, world=1)
    assert trainer.rl_step(rewarded_batch())["lr"] == pytest.approx((0.025 + 0.05) / 2)  # optimizer steps 0 and 1
    trainer.step = 5
    assert trainer.rl_step(rewarded_batch())["lr"] == pytest.approx(0.1)



def test_the_optimizer_takes_adams_decay_rates_from_the_run(tmp_path):
    local = Trainer(tiny_run(tmp_path), None, rank=0, world=1).optimizer.param_groups[0]["betas"]
    assert local == (0.9, 0.95)  # configs/runs/local.yaml's beta2; beta1 the default
    run = tiny_run(tmp_path, training={"adam_beta1": 0.8, "adam_beta2": 0.999})
    assert Trainer(run, None, rank=0, world=1).optimizer.param_groups[0]["betas"] == (0.8, 0.999)

@pytest.mark.parametrize("training, sampling, message", [
    ({"lr_warmup_steps": 300}, {}, "rl.training.lr_warmup_steps.*must be <= the run's policy optimizer steps"),
    ({"min_learning_rate": 0.5}, {}, "min_learning_rate.*must be between 0 and learning_rate"),
    ({"lr_schedule": "linear"}, {}, "lr_schedule"),
    ({"adam_beta2": 1.0}, {}, "rl.training.adam_beta2: 1.0 is not allowed; must be >= 0 and < 1"),
    ({"max_tokens_per_microbatch": 100}, {"max_prompt_tokens": 512, "max_tokens": 3},
     "max_tokens_per_microbatch.*must be >= the longest sample.*\\(514\\)"),
])
def test_training_config_errors_name_the_field_and_what_is_allowed(tmp_path, training, sampling, message):
    with pytest.raises(ConfigError, match=message):
        tiny_run(tmp_path, training=training, sampling=sampling)


def test_sigterm_on_one_rank_checkpoints_every_rank_at_the_same_step_and_exits_cleanly(tmp_path):
    path = write_run(tmp_path, algorithm=FAST, training={"steps": 6, "checkpoint_every": 10, "warmup_sft_steps": 0})
    ranks = run_ranks(2, loop_stopped_on_rank_1, str(path), rewarded_batch, 1)
    assert [r["stop_requested"] for r in ranks] == [False, True]  # only rank 1 got the signal
    assert [r["code"] for r in ranks] == [0, 0] and [r["step"] for r in ranks] == [2, 2]
    assert ranks[0]["latest"] == "step-00000002"  # committed: both ranks' shards and the metadata are in place
    # the weights went out in the background and were announced once in the store: in increasing order (a
    # version superseded before it was written is skipped), the last one for sure
    announced = ranks[0]["announced"]
    assert ranks[0]["lineage"] == 0 and announced[-1] == (0, 2) and announced == sorted(set(announced))
    assert ranks[0]["store_latest"] == VersionRef(0, 2)
    # started again, the trainer resumes at step 2 in a new lineage: its versions cannot be confused with the
    # dead lineage's
    again = run_ranks(2, loop_resumed, str(path), rewarded_batch)
    assert [r["step"] for r in again] == [6, 6] and [r["lineage"] for r in again] == [1, 1]
    announced = again[0]["announced"]
    assert announced[-1] == (1, 6) and announced == sorted(set(announced)) and {lin for lin, _ in announced} == {1}
    assert again[0]["store_latest"] == VersionRef(1, 6)
    # every published version is a complete checkpoint: tokenizer files and generation_config.json beside the weights
    run = load_run(path)
    stored = open_store(run.rl.weights, output_dir(run) / "weights").fetch(VersionRef(1, 6), tmp_path / "cache")
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in stored.iterdir()}


def test_checkpoint_round_trip_restores_weights_optimizer_and_step(tmp_path, world_of_one):
    run = tiny_run(tmp_path, algorithm={"name": "ppo", "kl_coef": 0.0})
    trainer = Trainer(run, None, rank=0, world=1)
    trainer.rl_step(rewarded_batch())
    trainer.step = 1
    saved = {k: v.detach().clone() for k, v in trainer._trained_state().items()}
    params = lambda t: [p for group in t.optimizer.param_groups for p in group["params"]]  # noqa: E731
    moments = [trainer.optimizer.state[p]["exp_avg"].clone() for p in params(trainer)]
    trainer.save_checkpoint()
    trainer.rl_step(rewarded_batch())  # the write runs in the background from a copy: training goes on
    trainer.poll_checkpoint(wait=True)
    assert (tmp_path / "out" / "checkpoints" / "LATEST").read_text() == "step-00000001"
    other = Trainer(run, None, rank=0, world=1)
    assert other.try_resume() and other.step == 1
    for name, tensor in other._trained_state().items():
        assert torch.equal(tensor, saved[name]), name
    assert all(torch.equal(other.optimizer.state[p]["exp_avg"], m) for p, m in zip(params(other), moments))
    assert all(float(other.optimizer.state[p]["step"]) == 1.0 for p in params(other))


@pytest.mark.parametrize("found, message", [
    (CHECKPOINT_FORMAT + 1, rf"format {CHECKPOINT_FORMAT + 1} is not readable here \(this code reads checkpoint "
                            rf"formats 1 to {CHECKPOINT_FORMAT}\): this checkpoint was written in format "
                            rf"{CHECKPOINT_FORMAT + 1} by a newer moe-rl-eks"),
    (0, r"format 0 is not readable here .*a format >= 1"),
    ("2", r"format '2' is not readable here .*an integer format >= 1")])
def test_a_checkpoint_of_a_format_this_code_cannot_read_is_refused_naming_found_and_supported(
        tmp_path, world_of_one, found, message):
    run = tiny_run(tmp_path)
    trainer = Trainer(run, None, rank=0, world=1)
    trainer.step = 1
    trainer.save_checkpoint()
    trainer.poll_checkpoint(wait=True)
    meta_path = tmp_path / "out" / "checkpoints" / "step-00000001" / "trainer.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == CHECKPOINT_FORMAT  # stamped by commit
    del meta["format"]  # a checkpoint from before formats were recorded: format 1's layout, read as it is
    meta_path.write_text(json.dumps(meta))
    assert Trainer(run, None, rank=0, world=1).try_resume()
    meta_path.write_text(json.dumps({**meta, "format": found}))
    with pytest.raises(CheckpointFormatError, match=message):
        Trainer(run, None, rank=0, world=1).try_resume()


def test_a_checkpoint_of_two_ranks_resumes_on_four_and_on_one_with_the_same_weights_and_moments(tmp_path):
    path = write_run(tmp_path, algorithm={"name": "ppo", **FAST})  # PPO: the critic is checkpointed too
    saved = run_ranks(2, train_and_checkpoint, str(path), varied_batch().to_json())[0]
    assert any(".mlp.experts." in name for name in saved) and "critic.net.0.weight.exp_avg" in saved
    on_four = run_ranks(4, resumed_state, str(path))
    on_one = full_state(Trainer(tiny_run(tmp_path, algorithm={"name": "ppo", **FAST}), None, rank=0, world=1))
    assert not any(torch.equal(t, saved[n]) for n, t in on_one.items() if ".mlp.experts." in n)  # before resuming
    resumed = resumed_state(0, 1, str(path))
    for state in (*on_four, resumed):
        assert state.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), name


def test_a_resumed_trainer_continues_bitwise_as_if_it_had_never_stopped(tmp_path):
    # 2 EP ranks (DTensor shards), PPO (critic, moments), entropy and mini-batches: everything a step keeps
    path = write_run(tmp_path, algorithm={"name": "ppo", "mini_batches": 2, "kl_coef": 0.0, "entropy_coef": 0.01})
    batches = [varied_batch(step).to_json() for step in range(4)]
    assert run_ranks(2, trained_then_resumed, str(path), batches) == [[], []]


def test_checkpoint_metadata_is_read_without_unpickling_arbitrary_objects(tmp_path):
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from moe_rl_eks.workloads.trainer import checkpoint as ckpt

    state = {"w": torch.randn(3, 2)}
    ckpt.save(state, tmp_path, asynchronous=False)
    loaded = {"w": torch.zeros(3, 2)}
    ckpt.load(loaded, tmp_path)
    assert torch.equal(loaded["w"], state["w"])

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    # DCP wraps the refusal in its CheckpointException, with our message
    with pytest.raises(CheckpointException, match="refers to builtins.print, which a DCP metadata file never holds"):
        ckpt.load(loaded, tmp_path)


def test_training_with_routing_replay_reproduces_the_rollout_logprobs(tmp_path, world_of_one):
    from moe_rl_eks.workloads.rollout.decoder import decode_all
    from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer

    run = tiny_run(tmp_path, algorithm={"routing_replay": True, "kl_coef": 0.0})
    trainer = Trainer(run, None, rank=0, world=1)
    tok = CharTokenizer()
    prompts = [tok.encode("3+4="), tok.encode("12+3=")]  # different lengths: left-padded together at rollout
    results = decode_all(trainer.model.eval(), [RowRequest(tuple(p), SamplingParams(3, seed=seed, return_routing=True),
                                                           str(seed), 0) for seed, p in enumerate(prompts * 2)],
                         [tok.eos_id])
    samples = [sample(i, p, r.token_ids, logprobs=r.logprobs, routing=trainer.routing_store.write(
        f"r{i}", r.routing, run.model.num_experts)) for i, (p, r) in enumerate(zip(prompts * 2, results))]
    t = Sequences.of(samples, trainer._read_routing).to(trainer.device)
    step = trainer.train_step

    def logprobs(replay):
        with torch.no_grad():
            return step.forward(trainer.model, t, temperature=1.0, replay=replay).logprobs

    # the trainer scores each completion token exactly as the rollout sampled it, on the same experts
    assert torch.allclose(logprobs(True) * t.mask, t.behaviour, atol=1e-5)
    # once the trainer's routers drift from the rollout's, replay still uses the rollout's experts; re-routing not
    with torch.no_grad():
        for layer in trainer.model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
        replayed = trainer.model(t.packed_inputs(), sequence_lengths=t.lengths, routing_replay=t.packed_routing(),
                                 return_routing=True)
        rerouted = trainer.model(t.packed_inputs(), sequence_lengths=t.lengths, return_routing=True)
    assert all(torch.equal(got, want) for got, want in zip(replayed.routing, t.packed_routing()))
    assert any(not torch.equal(got, want) for got, want in zip(rerouted.routing, t.packed_routing()))
    assert not torch.allclose(logprobs(True) * t.mask, logprobs(False) * t.mask)  # training follows the replay


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
    step.samples[1] = replace(step.samples[1], completion_ids=[2], logprobs=[-2.0])  # one padded position
    t = Sequences.of(step.samples).to(trainer.device)
    with torch.no_grad():
        load = trainer.model(t.packed_inputs(), sequence_lengths=t.lengths).expert_load.float()
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


@pytest.mark.parametrize("cuda, backend", [(True, "cpu:gloo,cuda:nccl"), (False, "gloo")])
def test_the_trainer_process_group_has_a_cpu_backend_beside_nccl_for_async_checkpoints(monkeypatch, cuda, backend):
    # DCP's async save asserts a CPU backend in the group it coordinates over; NCCL alone failed the first
    # checkpoint of a GPU trainer (tests/rl/test_trainer_gpu.py writes and resumes one on a GPU)
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(device=device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.update(backend=backend))
    monkeypatch.setenv("LOCAL_RANK", "3")
    init_trainer_process_group()
    assert calls == ({"backend": backend, "device": torch.device("cuda", 3)} if cuda else {"backend": backend})


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
    from moe_rl_eks.workloads.trainer.loop import initial_weights

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


def test_milestone_weights_are_written_only_where_something_reads_them(tmp_path):
    from dataclasses import replace as changed

    from moe_rl_eks.workloads.trainer.loop import eval_snapshots

    local = tiny_run(tmp_path)
    assert eval_snapshots(local, needs_reference=False) == ("initial", "warmup")  # local-run evaluates both
    cluster = changed(local, environment="dev")
    assert eval_snapshots(cluster, needs_reference=True) == ("warmup",)  # the KL reference's only
    assert eval_snapshots(cluster, needs_reference=False) == ()
    # a local run that evaluates nothing afterwards (a benchmark) keeps none, unless the KL reference reads one
    bench = changed(local, rl=changed(local.rl, evaluation=changed(local.rl.evaluation, snapshots=False)))
    assert eval_snapshots(bench, needs_reference=False) == ()
    assert eval_snapshots(bench, needs_reference=True) == ("warmup",)
