"""FSDP2 of the dense weights over the trainer's ranks, the experts split by EP (rl.training.fsdp): an RL step on
2 and 4 gloo ranks (and on 2 ranks one per GPU over NCCL, skipped without 2 GPUs) against one process on the same
batch, and a checkpoint written on that layout resumed on one rank. One process has no shards: it is the reference
for every layout."""
import pytest
import torch
import torch.distributed as dist
from rl_helpers import rewarded_batch, tiny_run, write_run
from test_trainer import varied_batch
from trainer_ranks import (bf16_warmup, ep_step_gradients, ep_step_gradients_from_reference, full_state, loop_resumed,
                           resumed_state, run_ranks, step_gradients, train_and_checkpoint, train_and_publish,
                           warm_then_reference)

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.rl.protocol import Batch
from moe_rl_eks.workloads.trainer.loop import Trainer

SECTIONS = {"training": {"fsdp": True, "max_tokens_per_microbatch": 9, "learning_rate": 0.01},
            "sampling": {"max_prompt_tokens": 4, "max_tokens": 6}}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


MOMENTS = (".exp_avg", ".exp_avg_sq")
# float32 sums over ranks in another order: measured up to 1.1e-6 on the router's gate (tiny entries, ~1e-8)
GRAD_TOLERANCE = 2e-6


def assert_steps_as_one_process(r: dict, want_metrics: dict, want_grads: dict, want_state: dict) -> None:
    """A rank's step against one process's: loss and gradient norm, every gradient, AdamW's moments."""
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


# One trainer rank per GPU over NCCL (the alltoall dispatch's bytes GPU to GPU), as on an H200 x2
PER_GPU = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    f"one trainer rank per GPU at 2 ranks needs 2 GPUs, this machine has {torch.cuda.device_count()}"))


@pytest.mark.parametrize("world, algorithm, per_gpu", [
    (2, "grpo", False), (4, "grpo", False), (4, "dr_grpo", False), (4, "gspo", False), (4, "ppo", False),
    (8, "ppo", False), (8, "gspo", False),
    pytest.param(2, "grpo", True, marks=PER_GPU), pytest.param(2, "ppo", True, marks=PER_GPU)])
def test_fsdp_over_ep_ranks_steps_as_one_process_loss_gradients_and_weights(tmp_path, world, algorithm, per_gpu):
    # entropy on, several micro-batches, layers recomputed (the default save_attention); PPO adds its critic,
    # kept replicated beside the sharded policy. per_gpu: EP2 and FSDP2 x EP2 over NCCL against one rank.
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
        layouts[fsdp] = run_ranks(world, ep_step_gradients, str(path), varied_batch().to_json(), per_gpu=per_gpu)
    for r in layouts[True]:
        assert_steps_as_one_process(r, want_metrics, want_grads, want_state)
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


@pytest.mark.parametrize("saved_on, saved_ep, resumed_on, resumed_ep, resumed_fsdp", [
    (4, None, 2, None, True), (4, None, 1, None, False), (2, None, 4, None, True),
    (4, 2, 2, None, True), (4, None, 4, 2, True), (4, 2, 1, None, False)])
def test_a_checkpoint_resumes_bitwise_on_another_ep_degree_and_fsdp_layout(tmp_path, saved_on, saved_ep, resumed_on,
                                                                            resumed_ep, resumed_fsdp):
    # EP4 x FSDP -> EP2 x FSDP and -> one rank; EP2 x FSDP -> EP4 x FSDP; EP 2 x 2 sharded copies -> EP2, -> one
    # rank, and EP4 -> EP 2 x 2: each rank reads the slices it owns now
    algo = {"name": "ppo", "kl_coef": 0.0, "entropy_coef": 0.0}
    model = {"num_experts": 8}

    def layout(ep, fsdp):
        return {**SECTIONS, "model": model, "training": {**SECTIONS["training"], "fsdp": fsdp, "expert_parallel": ep}}

    path = write_run(tmp_path, algorithm=algo, **layout(saved_ep, True))
    saved = run_ranks(saved_on, train_and_checkpoint, str(path), varied_batch().to_json())[0]
    assert "model.layers.0.self_attn.q_proj.weight.exp_avg" in saved and "critic.net.0.weight.exp_avg" in saved
    path = write_run(tmp_path, algorithm=algo, **layout(resumed_ep, resumed_fsdp))
    resumed = (run_ranks(resumed_on, resumed_state, str(path))[0] if resumed_on > 1
               else resumed_state(0, 1, str(path)))
    assert resumed.keys() == saved.keys()
    assert [name for name, tensor in saved.items() if not torch.equal(resumed[name], tensor)] == []


@pytest.mark.parametrize("world, expert_parallel", [(2, None), (4, 2)])
def test_the_fsdp_trainer_publishes_its_whole_weights_in_the_serving_dtype(tmp_path, world, expert_parallel):
    # EP 2 x 2 copies: the EP group of rank 0 writes the experts, the other group's copies write nothing
    path = write_run(tmp_path, algorithm={"kl_coef": 0.0, "entropy_coef": 0.0}, model={"num_experts": 8},
                     **{**SECTIONS, "training": {**SECTIONS["training"], "expert_parallel": expert_parallel}})
    rank0 = run_ranks(world, train_and_publish, str(path), varied_batch().to_json())[0]
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


def expert_layout(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """ep_step_gradients, and what this rank holds of one expert tensor and of its AdamW moment."""
    from moe_rl_eks.workloads.model.parallelize import local

    result = ep_step_gradients(rank, world, run_path, batch_json)
    trainer = Trainer(load_run(run_path), None, rank, world)
    experts = trainer.model.model.layers[0].mlp.experts.gate_up_proj
    result["held_experts"] = local(experts).shape[0]
    result["ep_group"] = dist.get_process_group_ranks(trainer.ep.group)
    return result


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_ep_over_half_the_ranks_shards_each_experts_copies_and_steps_as_one_process(tmp_path, algorithm):
    # EP 2 x 2 copies at 4 ranks (torchtitan's dp_shard_in_ep x dp_shard_mod_ep): each rank holds a quarter of
    # the experts, as at EP 4, and the step's gradients and moments are one process's
    algo = {"name": algorithm, "kl_coef": 0.0, "entropy_coef": 0.01}
    model = {"num_experts": 8}
    one = Trainer(tiny_run(tmp_path, algorithm=algo, model=model, **SECTIONS), None, rank=0, world=1)
    want_grads, want_metrics = step_gradients(one, varied_batch())
    want_state = full_state(one)
    (tmp_path / "ranks").mkdir()
    path = write_run(tmp_path / "ranks", algorithm=algo, model=model,
                     **{**SECTIONS, "training": {**SECTIONS["training"], "expert_parallel": 2}})
    ranks = run_ranks(4, expert_layout, str(path), varied_batch().to_json())
    assert [r["ep_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["held_experts"] for r in ranks] == [2, 2, 2, 2]  # 8 experts / 4 ranks
    for r in ranks:
        assert_steps_as_one_process(r, want_metrics, want_grads, want_state)


def test_bf16_parameters_with_float32_reduction_train_and_keep_float32_master_weights(tmp_path):
    # rl.training.fsdp_param_dtype: bfloat16: layers compute with bf16 gathers of float32 shards (AdamW's master
    # copy); gradients reduce in float32 and stay within bf16's rounding of the float32 policy's. Micro-batches of
    # 64 tokens, not SECTIONS' 9: the dtypes do not depend on how a step is split, and each micro-batch costs
    # FSDP's gathers and reductions (most of this test's time at 9).
    algo = {"name": "grpo", "kl_coef": 0.0, "entropy_coef": 0.0}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        (tmp_path / dtype).mkdir()
        path = write_run(tmp_path / dtype, algorithm=algo, **{**SECTIONS, "training": {
            **SECTIONS["training"], "fsdp_param_dtype": dtype, "warmup_learning_rate": 0.01,
            "max_tokens_per_microbatch": 64}})
        runs[dtype] = run_ranks(2, bf16_warmup, str(path), 4)[0]
    bf16, fp32 = runs["bfloat16"], runs["float32"]
    assert bf16["computed_in"] == torch.bfloat16 and fp32["computed_in"] == torch.float32
    assert bf16["reduce_dtype"] == torch.float32
    assert bf16["master_dtype"] == bf16["grad_dtype"] == torch.float32
    losses = bf16["losses"]
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True)  # it trains
    assert losses[0] == pytest.approx(fp32["losses"][0], rel=2e-2)
    for name, grad in fp32["grads"].items():
        assert 0 < relative_error(bf16["grads"][name], grad) < 5e-2, name  # bf16 rounding, not float32's


@pytest.mark.parametrize("training, world, message", [
    ({"fsdp": False, "expert_parallel": 2}, 4, "ep_degree 2 < 4 ranks shards the experts' copies with FSDP"),
    ({"expert_parallel": 3}, 4, "EP must span every rank or a divisor of them >= 2"),
])
def test_ep_over_part_of_the_ranks_is_refused_before_any_collective_naming_the_field(tmp_path, training, world,
                                                                                       message):
    from moe_rl_eks.core.schema import ConfigError

    run = tiny_run(tmp_path, model={"num_experts": 8}, **{**SECTIONS, "training": {**SECTIONS["training"], **training}})
    with pytest.raises(ConfigError, match=f"rl.training.expert_parallel.*{message}"):
        Trainer(run, None, rank=0, world=world)
