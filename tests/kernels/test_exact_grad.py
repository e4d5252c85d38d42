"""The exact numerics mode's differentiable forward (trainer/numerics.py's ExactScorer.forward over
model/exact_autograd.py's kernels): its logprobs and entropies are the no-grad scorer's bits (and so the rollout
engine's: test_exact_rollout_trainer.py), its gradients of every parameter (experts, router and a shared expert
included) the float32 model's, and a batch's first optimizer step runs it as its only forward per micro-batch,
stepping the policy as the two-forward path did. A tiny model under Triton's interpreter; its dtype float32
(TINY's), so the standard formulas' gradients differ from float32 autograd's by float32 rounding alone."""
import dataclasses

import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.tools.bench.rollout import QWEN3_30B_A3B, TINY
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.logprobs import token_logprobs_and_entropy
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers
from moe_rl_eks.workloads.model.transformer import DecoderLayer
from moe_rl_eks.workloads.rl.protocol import TrainingSample, VersionRef, one_version
from moe_rl_eks.workloads.trainer.microbatch import Sequences
from moe_rl_eks.workloads.trainer.numerics import ExactScorer
from moe_rl_eks.workloads.trainer.step import TrainStep

# two layers (the second one's norm adds the first one's output), top-3 of 8 experts and a shared one, a balance
# loss
CONFIG = dataclasses.replace(TINY, num_hidden_layers=2, vocab_size=96, num_experts_per_tok=3, n_shared_experts=1,
                             router_aux_loss_coef=0.01)
TEMPERATURE = 0.8
ENTROPY_COEF = 0.1
# Each parameter's gradient against the float32 model's, relative to its norm: float32 rounding (the two differ
# in the order of their sums) is ~1e-6 here; a wrong term of any gradient would be of order 1.
GRAD_RTOL = 1e-4
# (prompt, completion) lengths: 26 tokens (the MoE layers' grouped path), and 8 (at most 16 tokens, where the
# no-grad scorer's MoE layers take the decode kernels and the differentiable forward still the grouped path)
SHAPES = {"grouped": [(9, 5), (3, 6), (1, 2)], "few_tokens": [(3, 2), (2, 1)]}
# the exact kernels on CPU tensors; compiled on a GPU, the 30B-layer-shape test below
ON_THE_INTERPRETER = pytest.mark.skipif(not INTERPRET, reason="the interpreter's form")


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    torch.nn.init.normal_(model.lm_head.weight, std=0.16)  # logits with a spread (a random init's are nearly uniform)
    return model


def microbatch(shape: list[tuple[int, int]], seed: int, vocab: int = CONFIG.vocab_size) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    samples = [TrainingSample(f"s{i}", torch.randint(0, vocab, (p,), generator=g).tolist(),
                              torch.randint(0, vocab, (c,), generator=g).tolist(), [-1.0] * c,
                              float(i % 2) - 0.5, float(i % 2) - 0.5, True, one_version(VersionRef(0, 0), c))
               for i, (p, c) in enumerate(shape)]
    return Sequences.of(samples)


def scorer_of(policy: MoETransformer) -> ExactScorer:
    scorer = ExactScorer(policy, next(policy.parameters()).device)
    scorer.load(policy.state_dict())  # what Trainer.publish hands it with each version
    return scorer


def objective(logprobs: torch.Tensor, entropy: torch.Tensor, aux_loss: torch.Tensor, mb: Sequences) -> torch.Tensor:
    """A policy-gradient loss with an entropy bonus and the balance loss: every output carries a gradient."""
    return -((logprobs * mb.advantages[:, None] + ENTROPY_COEF * entropy) * mb.mask).sum() + aux_loss


@ON_THE_INTERPRETER
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_differentiable_exact_forward_gives_the_scorers_bits_and_the_float32_models_gradients(policy, shape):
    mb = microbatch(shape, seed=len(shape))
    scorer = scorer_of(policy)
    logprobs, entropy = scorer.logprobs(mb, TEMPERATURE)
    policy.zero_grad(set_to_none=True)
    out = scorer.forward(mb, TEMPERATURE)
    assert torch.equal(out.logprobs, logprobs) and torch.equal(out.entropy, entropy)
    objective(out.logprobs, out.entropy, out.aux_loss, mb).backward()
    assert all(p.grad is None for p in scorer.model.parameters()), "the copy kept a gradient"
    exact_grads = {name: p.grad for name, p in policy.named_parameters()}

    policy.zero_grad(set_to_none=True)
    ref = policy(mb.packed_inputs(), sequence_lengths=mb.lengths, logits=False)
    ref_logprobs, ref_entropy = token_logprobs_and_entropy(ref.hidden[0], policy.lm_head.weight, mb.packed_targets(),
                                                           temperature=TEMPERATURE)
    assert torch.equal(out.expert_load, ref.expert_load)
    assert out.aux_loss > 0 and torch.allclose(out.aux_loss, ref.aux_loss, rtol=1e-5)
    objective(mb.unpack(ref_logprobs), mb.unpack(ref_entropy), ref.aux_loss, mb).backward()
    for name, p in policy.named_parameters():
        assert exact_grads[name] is not None and p.grad.norm() > 0, name
        assert (exact_grads[name] - p.grad).norm() <= GRAD_RTOL * p.grad.norm(), name
    policy.zero_grad(set_to_none=True)


def step_twice(policy: MoETransformer, differentiable: bool, monkeypatch) -> tuple[dict, dict, int]:
    """One SGD step of a copy of `policy` on two micro-batches as a batch's first optimizer step in the exact
    mode: (its parameters after, the step's result, the policy's own forwards that ran)."""
    model = MoETransformer(CONFIG)
    model.load_state_dict(policy.state_dict())
    scorer = scorer_of(model)
    scorer.differentiable = differentiable  # False: the two-forward path, as where the copy cannot train
    step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=1.0), ep=None, world=1, rank=0,
                     device=torch.device("cpu"), grad_clip=1e9, bf16=False, exact=scorer)
    forwards: list[int] = []
    model.register_forward_hook(lambda module, args, output: forwards.append(1))
    scored = []
    exact_forward = scorer.forward
    monkeypatch.setattr(scorer, "forward", lambda *a, **k: scored.append(1) or exact_forward(*a, **k))
    microbatches = [microbatch(SHAPES["grouped"], seed=1), microbatch(SHAPES["few_tokens"], seed=2)]

    def loss_fn(j, mb, fwd):
        return objective(fwd.logprobs, fwd.entropy, fwd.aux_loss, mb), {}

    result = step.step(microbatches, loss_fn, lr=1.0, temperature=TEMPERATURE, replay=False, exact_values=True)
    assert len(scored) == (len(microbatches) if differentiable else 0)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, result, len(forwards)


@ON_THE_INTERPRETER
def test_a_batchs_first_step_runs_one_forward_per_microbatch_and_steps_as_the_two_forward_path(policy, monkeypatch):
    one, result, fast_forwards = step_twice(policy, True, monkeypatch)
    two, twin_result, twin_fast_forwards = step_twice(policy, False, monkeypatch)
    assert (fast_forwards, twin_fast_forwards) == (0, 2)  # the exact forward alone, then beside each fast one
    assert torch.equal(result["expert_load"], twin_result["expert_load"])
    assert result["grad_norm"] == pytest.approx(twin_result["grad_norm"], rel=GRAD_RTOL)
    for name, before in policy.named_parameters():
        update, twin_update = one[name] - before, two[name] - before
        assert twin_update.norm() > 0, name
        assert (update - twin_update).norm() <= GRAD_RTOL * twin_update.norm(), name


@ON_THE_INTERPRETER
@pytest.mark.parametrize("mode", ["full", "save_attention"])
def test_under_activation_checkpointing_the_exact_layers_backward_is_the_policys_recomputed_layers(policy, mode,
                                                                                                   monkeypatch):
    model = MoETransformer(CONFIG)
    model.load_state_dict(policy.state_dict())
    checkpoint_layers(model, mode)
    scorer = scorer_of(model)
    step = TrainStep(model, None, torch.optim.SGD(model.parameters(), lr=0.0), ep=None, world=1, rank=0,
                     device=torch.device("cpu"), grad_clip=1.0, bf16=False, exact=scorer)
    attends, recomputed = [], []
    attend, layer_forward = scorer.kernels.attend, DecoderLayer.forward
    monkeypatch.setattr(scorer.kernels, "attend", lambda *a: attends.append(1) or attend(*a))
    monkeypatch.setattr(DecoderLayer, "forward", lambda *a: recomputed.append(1) or layer_forward(*a))
    mb = microbatch(SHAPES["grouped"], seed=4)
    fwd = step.forward(model, mb, temperature=TEMPERATURE, replay=False, exact_values=True)
    assert torch.equal(fwd.logprobs, scorer.logprobs(mb, TEMPERATURE)[0])
    assert not recomputed
    objective(fwd.logprobs, fwd.entropy, fwd.aux_loss, mb).backward()
    # each policy layer once, in the backward; the exact layers never again (the forward's and the scoring's)
    assert len(recomputed) == CONFIG.num_hidden_layers and len(attends) == 2 * CONFIG.num_hidden_layers
    exact_grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(p.grad is None for p in scorer.model.parameters()), "the copy kept a gradient"

    model.zero_grad(set_to_none=True)
    checkpoint_layers(model, "off")
    ref = model(mb.packed_inputs(), sequence_lengths=mb.lengths, logits=False)
    ref_logprobs, ref_entropy = token_logprobs_and_entropy(ref.hidden[0], model.lm_head.weight, mb.packed_targets(),
                                                           temperature=TEMPERATURE)
    objective(mb.unpack(ref_logprobs), mb.unpack(ref_entropy), ref.aux_loss, mb).backward()
    for name, p in model.named_parameters():
        assert (exact_grads[name] - p.grad).norm() <= GRAD_RTOL * p.grad.norm(), name


# the compiled kernels: tools/gpu_runs/h200-exact.sh runs tests/kernels with --noconftest
ON_A_GPU = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="compiled on a GPU")


@ON_A_GPU
@pytest.mark.parametrize("checkpointing", ["off", "save_attention"])
def test_at_the_30b_layer_shape_the_exact_forwards_gradients_are_the_autocast_forwards(checkpointing):
    """Qwen3-30B-A3B's layers (2 of 48) and vocabulary: float32 masters under bf16 autocast against the exact
    forward of their bf16 copy (its own backward, or the policy's recomputed layers'). The two differ by bf16
    rounding of different activations (the copy's residual stream is bf16, autocast's float32): each gradient
    within 10 % of the other's norm, where a wrong term would be ~100 %."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        policy = MoETransformer(dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=2), compute="triton")
    checkpoint_layers(policy, checkpointing)
    scorer = scorer_of(policy)
    step = TrainStep(policy, None, torch.optim.SGD(policy.parameters(), lr=0.0), ep=None, world=1, rank=0,
                     device=torch.device("cuda"), grad_clip=1.0, bf16=True, exact=scorer)
    mb = microbatch([(64, 448), (32, 224)], seed=3, vocab=QWEN3_30B_A3B.vocab_size).to(torch.device("cuda"))
    grads = []
    for exact_values in (True, False):
        fwd = step.forward(policy, mb, temperature=TEMPERATURE, replay=False, exact_values=exact_values)
        objective(fwd.logprobs, fwd.entropy, fwd.aux_loss, mb).backward()
        grads.append({name: p.grad for name, p in policy.named_parameters()})
        policy.zero_grad(set_to_none=True)
    for name, fast in grads[1].items():
        relative = float((grads[0][name] - fast).norm() / fast.norm())
        print(f"{checkpointing} {name}: |exact - autocast| / |autocast| = {relative:.4f}")
        assert relative <= 0.1, name
