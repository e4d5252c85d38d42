"""The trainer's side of the rollout/trainer logprob agreement: the exact numerics mode's logprob forward, and the
mismatch between the rollout's logprobs and the trainer's that training reports every step in both modes.

In the exact mode (`numerics: exact`) the trainer scores a batch's tokens with the rollout engine's own forward
(model/paged_forward.py's `sequence_hidden` on the `exact` backend, then its LM head) over a copy of the policy in
the served dtype, loaded from the very state each version is published from: the weights the rollout servers sampled
with, through the same batch-invariant kernels, so a token's logits, and its logprob from the shared row-wise
log-softmax (the engine's sampler calls the same model/logprobs.softmax_stats), are the engine's bits. The logits
are made and reduced a chunk of tokens at a time (`chunked_softmax_stats`): the LM head's invariant matmul and the
log-softmax are row-wise, so a token's bits do not depend on the chunking, and the [tokens, vocabulary] logits
(5 GB in bf16 at 16,384 tokens of Qwen3's 151,936) never exist at once.

The copy is right only until the first optimizer step of a batch changes the policy; the behaviour/proximal scoring
and that first step's current logprobs take their values from it (`exact_values`). The scoring needs no gradient,
so it runs the exact forward alone (TrainStep.score; PPO's critic reads that forward's hidden states). A batch that
takes several optimizer steps is scored before the first, and that step takes its current logprobs from the
scoring (the same policy, the same bits: the trainer loop's `reuse`) with the fast forward's gradient, so exact mode
costs it the exact forward in place of the standard scoring's fast one.

A batch of one optimizer step is not scored: its step's one forward per micro-batch is the exact one, made
differentiable (`ExactScorer.forward`): the same kernels called alike, so the same bits as `logprobs`, each op an
autograd Function whose backward is the standard formula (model/exact_autograd.py: torch matmuls for the products,
the fast forward's fused training norms recomputed, SDPA recomputed per sequence for the attention; the MoE layers'
route, permute, exact expert GEMM and combine have their own backward; the LM head's values from the invariant
product, its gradient from model/logprobs.py's chunked backward). The gradient is the copy's, in its served dtype,
as autocast's bf16 products give the fast forward's: each of the copy's parameters hands it, as it is accumulated,
to the policy's float32 master parameter of the same name (`hand_gradients_to`), before the step's
replicated-gradient sync; under expert parallelism both hold this rank's experts. It keeps every layer's
activations, and its attention forward runs once more in its backward (the exact kernel keeps no log-sum-exp for
flash attention's backward to read). Where the policy checkpoints its layers (activation_checkpointing full or
save_attention), each exact layer keeps its input alone and its backward is the policy's own layer's, recomputed
from that input with the exact routing replayed (exact_recompute.py): the standard step with its first forward on
the exact kernels. Where FSDP shards the policy or context parallelism splits a micro-batch (`trains_on_the_copy`
says why), the step runs two forwards instead: the exact one for the values, the fast one for the gradient, joined
by `values_with_gradient`. `moerl bench-train --exact` measures the first step and the scoring both ways.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..model import MoETransformer
from ..model.backends import get_forward_kernels
from ..model.checkpoint import empty_model
from ..model.exact_autograd import DifferentiableKernels
from ..model.logprobs import chunked_softmax_stats, token_logprobs_and_entropy
from ..model.paged_forward import PackedAttention, sequence_hidden
from ..model.parallelize import is_sharded
from ..model.transformer import aux_loss
from .microbatch import Sequences

# Logits per chunk of the exact scorer's LM head: 512 MiB in bf16 (1,766 tokens at Qwen3's vocabulary). No
# gradient follows, so unlike the training chunk (model/logprobs.CHUNK_ELEMENTS) nothing is gained by larger ones:
# the invariant matmul's fixed tiles fill the GPU at a few hundred rows of a 151,936-column product.
CHUNK_LOGITS = 2**28


@dataclass
class ExactForward:
    """The exact forward of a micro-batch with its graph: per-token outputs [B, S] (zero on padding), the final
    hidden states of its packed tokens [N, hidden], and what its MoE layers report."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    hidden: torch.Tensor
    aux_loss: torch.Tensor
    expert_load: torch.Tensor  # [L, E]


def trains_on_the_copy(policy: MoETransformer) -> bool:
    """Whether a batch's first step takes its gradient from the exact forward (ExactScorer.forward). Not where FSDP
    shards the policy's weights: their gradients are shards that FSDP's backward reduce-scatters from the
    parameters it gathered for its own forward, and the copy's whole gradients would need a reduce-scatter of their
    own into them. Nor under context parallelism (which a run refuses in exact mode today): the exact forward runs a
    rank's whole micro-batch, while a CP step's gradient is each rank's slice's, summed over the group."""
    return policy.cp is None and not any(is_sharded(p) for p in policy.parameters())


def hand_gradients_to(copy: nn.Module, policy: nn.Module) -> None:
    """Each of the copy's parameters hands its gradient, as soon as it is accumulated, to the policy's parameter of
    the same name (the same slice of the experts under EP), added in the policy's dtype: what autocast's cast does
    with a bf16 product's gradient on its way to a float32 master weight. The copy drops its own, so it never holds
    a whole model's gradient, and a micro-batch's gradient is added to the others' in float32, as autocast's are."""
    masters = dict(policy.named_parameters())
    for name, param in copy.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(_hand_over, masters[name]))


def _hand_over(master: torch.Tensor, param: torch.Tensor) -> None:
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)  # promoted to the master's dtype element by element: no float32 copy
    param.grad = None


class ExactScorer:
    """A copy of the policy in its served dtype on the `exact` backend. It costs the served weights' memory once
    more. Under expert parallelism it holds this rank's experts and its MoE layers dispatch over the policy's EP
    group (the all-to-all: core/run.py refuses DeepEP in exact mode), so every rank of the group calls `logprobs`
    (or `forward`) for each micro-batch, an empty one too. A token's logprob is still one rank's bits: the exact
    expert GEMM gives a row the same bits whatever other rows its expert got, and the combine adds a token's expert
    outputs on its own rank in slot order, as on one rank (permute.py's unpermute)."""

    def __init__(self, policy: MoETransformer, device: torch.device) -> None:
        self.model = empty_model(policy.config, policy.ep, "exact", device).eval()
        self.chunk_tokens = max(1, CHUNK_LOGITS // policy.config.vocab_size)  # tokens per chunk of logits
        self.kernels = get_forward_kernels("exact")
        self.packed: PackedAttention | None = None  # built at the first load (from real weights)
        self.differentiable = trains_on_the_copy(policy)
        if self.differentiable:
            hand_gradients_to(self.model, policy)

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Take the weights of a version as it is published (`state`: every tensor whole but the experts, which
        are this rank's slice; the trainer's dtype), cast to the served dtype as the publisher casts them (round to
        nearest even)."""
        mine = self.model.state_dict()
        for name, tensor in state.items():
            mine[name].copy_(tensor)
        if self.packed is None:
            self.packed = PackedAttention(self.model)
        else:
            self.packed.load(self.model)

    def _loaded(self) -> PackedAttention:
        if self.packed is None:
            raise RuntimeError("ExactScorer used before load: no version's weights yet")
        return self.packed

    @torch.no_grad()
    def logprobs(self, mb: Sequences, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(target), entropy) [B, S] of the micro-batch's tokens at `temperature`, zero on padding."""
        hidden, _, _ = sequence_hidden(self.model, self._loaded(), self.kernels, mb.packed_inputs()[0], mb.lengths)
        head = self.model.lm_head.weight
        logp, entropy, _ = chunked_softmax_stats(hidden, lambda rows: self.kernels.linear(rows, head),
                                                 mb.packed_targets(), temperature, self.chunk_tokens)
        return mb.unpack(logp), mb.unpack(entropy)

    def forward(self, mb: Sequences, temperature: float, run_layer: Callable | None = None) -> ExactForward:
        """`logprobs`' values, bit for bit (the same kernels, called alike), with autograd where grad is enabled
        (model/exact_autograd.py: each op's backward is the standard formula's), the MoE layers' balance loss and
        expert load too. Its gradient reaches the policy's parameters' .grad (`hand_gradients_to`), only where
        `differentiable`. `run_layer`: paged_hidden's (exact_recompute.policy_recompute: each layer's backward the
        policy's own layer, recomputed)."""
        self._loaded()
        config, head = self.model.config, self.model.lm_head.weight
        hidden, _, layers = sequence_hidden(self.model, PackedAttention.differentiable(self.model),
                                            DifferentiableKernels(self.kernels, mb.lengths), mb.packed_inputs()[0],
                                            mb.lengths, training=True, run_layer=run_layer)
        logp, entropy = token_logprobs_and_entropy(hidden, head, mb.packed_targets(), temperature=temperature,
                                                   head=lambda rows: self.kernels.linear(rows, head))
        return ExactForward(mb.unpack(logp), mb.unpack(entropy), hidden,
                            aux_loss(config, [m.aux_loss for m in layers]), torch.stack([m.load for m in layers]))


def values_with_gradient(values: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
    """`values` exactly (bit for bit), with the gradient of `differentiable`: x - x.detach() is exactly 0."""
    return values + (differentiable - differentiable.detach())


class MismatchTally:
    """The rollout's logprobs against the trainer's at the weights a batch starts from, over its completion
    tokens: how many are bitwise equal, the mean and the max of |d log p|, and the KL between the two policies both
    ways, estimated from the rollout's samples with d = log p_trainer - log p_rollout: KL(rollout || trainer) by
    k3 = e^d - 1 - d, KL(trainer || rollout) by importance weighting, d e^d - (e^d - 1) (each term >= 0, zero when
    d = 0). Added to micro-batch by micro-batch, reduced over ranks once."""

    def __init__(self, device: torch.device) -> None:
        # tokens, bitwise equal, sum |d|, sum of each KL's terms
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)
        self.max = torch.zeros(1, dtype=torch.float64, device=device)

    def add(self, trainer: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        """trainer, behaviour logprobs and the completion mask, [B, S] each."""
        d = (trainer.detach().double() - behaviour.double())[mask > 0]
        grown = torch.expm1(d)  # e^d - 1 without the cancellation at the small d of a close match
        self.sums += torch.stack([d.new_tensor(d.numel()), (d == 0).sum().double(), d.abs().sum(),
                                  (grown - d).sum(), (d * (grown + 1) - grown).sum()])
        if d.numel():
            self.max = torch.maximum(self.max, d.abs().max().reshape(1))

    def metrics(self, batch_sum: Callable[[torch.Tensor], torch.Tensor],
                batch_max: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The batch's numbers, reduced by the caller's `batch_sum` and `batch_max` over ranks (collectives)."""
        tokens, equal, total, kl_rollout_trainer, kl_trainer_rollout = batch_sum(self.sums).tolist()
        most = float(batch_max(self.max))
        tokens = max(tokens, 1.0)
        return {"logprob_bitwise_equal": equal / tokens, "logprob_abs_diff_mean": total / tokens,
                "logprob_abs_diff_max": most, "logprob_kl_rollout_trainer": kl_rollout_trainer / tokens,
                "logprob_kl_trainer_rollout": kl_trainer_rollout / tokens}
