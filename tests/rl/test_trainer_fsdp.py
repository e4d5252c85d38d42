"""FSDP2 of the dense weights over the trainer's ranks, the experts split by EP (rl.training.fsdp): an RL step on
2 and 4 gloo ranks against one process on the same batch, and a checkpoint written on that layout resumed on one
rank. One process has no shards: it is the reference for every layout."""
import pytest
import torch
from rl_helpers import rewarded_batch, tiny_run, write_run
from test_trainer import varied_batch
from trainer_ranks import (ep_step_gradients, ep_step_gradients_from_reference, full_state, loop_resumed,
                           resumed_state, run_ranks, step_gradients, train_and_checkpoint, train_and_publish,
                           warm_then_reference)

from moe_rl_eks.workloads.rl.protocol import Batch
from moe_rl_eks.workloads.trainer.loop import Trainer

SECTIONS = {"training": {"fsdp": True, "max_tokens_per_microbatch": 9, "learning_rate": 0.01},
            "sampling": {"max_prompt_tokens": 4, "max_tokens": 6}}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


MOMENTS = (".exp_avg", ".exp_avg_sq")
# float32 sums over ranks in another order: measured up to 1.1e-6 on the router's gate (tiny entries, ~1e-8)
GRAD_TOLERANCE = 2e-6


@pytest.mark.parametrize("world, algorithm", [(2, "grpo"), (4, "grpo"), (4, "dr_grpo"), (4, "gspo"), (4, "ppo"),
                                              (8, "ppo"), (8, "gspo")])
def test_fsdp_over_ep_ranks_steps_as_one_process_loss_gradients_and_weights(tmp_path, world, algorithm):
    # entropy on, several micro-batches, layers recomputed (the default save_attention); PPO adds its critic,
    # kept replicated beside the sharded policy
    algo = {"name": algorithm, "kl_coef": 0.0, "entropy_coef": 0.01}
    model = {"num_experts": max(4, world)}  # one expert a rank at least
    one = Trainer(tiny_run(tmp_path, algorithm=algo, model=model, **SECTIONS), None, rank=0, world=1)
    want_grads, want_metrics = step_gradients(one, varied_batch())
    want_state = full_state(one)
    layouts = {}
    for fsdp in (True, False):  # FSDP x EP, and the EP trainer with replicated dense weights
        sections = {**SECTIONS, "model": model, "training": {**SECTIONS["training"], "fsdp": fsdp}}
        (tmp_path / f"fsdp-{fsdp}").mkdir()
        path = write_run(tmp_path / f"fsdp-{fsdp}", algorithm=algo, **sections)
        layouts[fsdp] = run_ranks(world, ep_step_gradients, str(path), varied_batch().to_json())
    for r in layouts[True]:
        assert r["metrics"]["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6)
        assert r["metrics"]["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-6)
        assert r["grads"].keys() == want_grads.keys() and r["state"].keys() == want_state.keys()
        for name, grad in want_grads.items():
            assert relative_error(r["grads"][name], grad) < GRAD_TOLERANCE, name
        for name, tensor in want_state.items():
            if name.endswith(MOMENTS):  # AdamW's moments: the gradients' running mean and mean square
                # the mean square's relative error is twice the gradient's
                bound = GRAD_TOLERANCE * (2 if name.endswith("_sq") else 1)
                assert relative_error(r["state"][name], tensor) < bound, name
    # The weights after the step: AdamW's first step is about lr * sign(gradient), so an entry whose gradient is
    # rounding noise may step either way in any layout with another summation order. FSDP stays as close to one
    # process as the EP trainer does (each within about 1e-5 of the weight's norm at this learning rate).
    for fsdp_rank, ep_rank in zip(layouts[True], layouts[False]):
        for name, tensor in want_state.items():
            if not name.endswith(MOMENTS):
                ep_error = relative_error(ep_rank["state"][name], tensor)
                assert relative_error(fsdp_rank["state"][name], tensor) <= 2 * ep_error + 1e-7, name
    assert ("critic.net.0.weight" in want_state) == (algorithm == "ppo")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_rank_with_no_samples_under_fsdp_still_gives_the_gradient_of_one_process(tmp_path, algorithm):
    # Its forwards are empty: attention's projections leave its graph, and FSDP reduce-scatters zeros for them
    # (reduce_scatter_unused_params), so both ranks' collectives stay the same size. PPO: its GAE has no tokens.
    algo = {"name": algorithm, "kl_coef": 0.0, "entropy_coef": 0.01}
    batch = Batch(0, 0, varied_batch().samples[2:3], varied_batch().stats)
    want, want_metrics = step_gradients(Trainer(tiny_run(tmp_path, algorithm=algo, **SECTIONS), None, 0, 1), batch)
    ranks = run_ranks(2, ep_step_gradients, str(write_run(tmp_path, algorithm=algo, **SECTIONS)), batch.to_json())
    assert [r["samples"] for r in ranks] == [["p2/0"], []]
    for r in ranks:
        assert r["metrics"]["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6)
        for name, grad in want.items():
            assert relative_error(r["grads"][name], grad) < GRAD_TOLERANCE, name


@pytest.mark.parametrize("saved_on, resumed_on, resumed_fsdp", [(4, 2, True), (4, 1, False), (2, 4, True)])
def test_a_checkpoint_resumes_bitwise_on_another_ep_degree_and_fsdp_layout(tmp_path, saved_on, resumed_on,
                                                                            resumed_fsdp):
    # EP4 x FSDP -> EP2 x FSDP and -> one rank; EP2 x FSDP -> EP4 x FSDP: each rank reads the slices it owns now
    algo = {"name": "ppo", "kl_coef": 0.0, "entropy_coef": 0.0}
    path = write_run(tmp_path, algorithm=algo, **SECTIONS)
    saved = run_ranks(saved_on, train_and_checkpoint, str(path), varied_batch().to_json())[0]
    assert "model.layers.0.self_attn.q_proj.weight.exp_avg" in saved and "critic.net.0.weight.exp_avg" in saved
    path = write_run(tmp_path, algorithm=algo, **{**SECTIONS, "training": {**SECTIONS["training"],
                                                                           "fsdp": resumed_fsdp}})
    resumed = (run_ranks(resumed_on, resumed_state, str(path))[0] if resumed_on > 1
               else resumed_state(0, 1, str(path)))
    assert resumed.keys() == saved.keys()
    assert [name for name, tensor in saved.items() if not torch.equal(resumed[name], tensor)] == []


def test_the_fsdp_trainer_publishes_its_whole_weights_in_the_serving_dtype(tmp_path):
    path = write_run(tmp_path, algorithm={"kl_coef": 0.0, "entropy_coef": 0.0}, **SECTIONS)
    rank0 = run_ranks(2, train_and_publish, str(path), varied_batch().to_json())[0]
    published, state = rank0["published"], rank0["state"]
    assert published.keys() == {name for name in state if not name.endswith(MOMENTS)}
    for name, tensor in published.items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def test_the_kl_reference_is_sharded_as_the_policy_and_the_step_equals_one_processes(tmp_path):
    algo = {"name": "grpo", "kl_coef": 0.05, "entropy_coef": 0.0}
    one = Trainer(tiny_run(tmp_path, algorithm=algo, **SECTIONS), None, rank=0, world=1)
    warm_then_reference(one)
    want_grads, want_metrics = step_gradients(one, varied_batch())
    assert want_metrics["kl"] > 0  # the policy has moved off its reference: the KL term has a gradient
    (tmp_path / "ranks").mkdir()
    path = write_run(tmp_path / "ranks", algorithm=algo, **SECTIONS)
    for r in run_ranks(2, ep_step_gradients_from_reference, str(path), varied_batch().to_json()):
        assert r["reference_embedding_sharded"]
        # the KL is a small difference of log-probabilities: their float32 rounding is a larger part of it
        assert r["metrics"]["kl"] == pytest.approx(want_metrics["kl"], rel=1e-4)
        assert r["metrics"]["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6)
        for name, grad in want_grads.items():
            assert relative_error(r["grads"][name], grad) < GRAD_TOLERANCE, name


def test_the_fsdp_trainer_loop_warms_up_keeps_a_kl_reference_checkpoints_and_resumes(tmp_path):
    # local.yaml's KL term (0.05): the reference beside the sharded policy, sharded as it is
    path = write_run(tmp_path, training={"steps": 3, "checkpoint_every": 2, "warmup_sft_steps": 1, "fsdp": True})
    first = run_ranks(2, loop_resumed, str(path), rewarded_batch)
    assert [r["step"] for r in first] == [3, 3] and first[0]["latest"] == "step-00000003"
    # versions are announced once written, in order; one superseded before its write is skipped (publisher.py)
    announced = first[0]["announced"]
    assert announced[-1] == (0, 3) and announced == sorted(set(announced))
    again = run_ranks(2, loop_resumed, str(path), rewarded_batch)
    assert [r["lineage"] for r in again] == [1, 1] and again[0]["announced"] == [(1, 3)]
