"""One optimizer step of the trainer, from tensors: forward each micro-batch (packed sequences, hidden states,
chunked token log-probabilities), its loss, backward (gradients accumulate), then the gradient all-reduce of the
replicated weights (FSDP's shards were reduce-scattered in the backward), the global gradient norm and clipping,
the optimizer step. Everything a step reports (loss terms, the norm's part from weights split over ranks, each
rank's arrival time, the expert load) is reduced in ONE all-reduce.

It knows nothing of fetching, publishing, checkpoints or signals (trainer.py's loop), nor of the algorithm beyond
the loss function it is handed. Under expert parallelism every forward is a collective, so every rank must run
the same number of micro-batches: a rank with fewer (or no) samples runs empty ones."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_rl_eks.core.rl_config import TrainingConfig

from ..model import MoETransformer
from ..model.logprobs import token_logprobs_and_entropy
from ..model.parallelize import checkpointed, is_sharded, local
from ..moe.parallel import ExpertParallel
from .critic import Critic, CriticInputs, prefix_features
from .exact_recompute import policy_recompute
from .microbatch import Sequences
from .numerics import ExactScorer, values_with_gradient

EXPERT_MARK = ".mlp.experts."


@dataclass
class Forward:
    """Per-token outputs of one micro-batch, [B, S] (zero on padding)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None  # the critic's, PPO only
    aux_loss: torch.Tensor
    expert_load: torch.Tensor  # [L, E]
    critic_inputs: CriticInputs | None = None  # what the critic read, PPO only


# (index in the step's micro-batches, the micro-batch, its forward) -> (loss to backpropagate, metrics: sums that
# add up over micro-batches and ranks)
LossFn = Callable[[int, Sequences, Forward], tuple[torch.Tensor, dict[str, float]]]
# the same, of the critic alone: (index, the micro-batch, the critic's values [B, S] with their graph)
ValueLossFn = Callable[[int, Sequences, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def learning_rate(cfg: TrainingConfig, optimizer_step: int, total_steps: int) -> float:
    """rl.training's schedule at a 0-based optimizer step: linear warm-up from 0 over lr_warmup_steps, then
    constant or a cosine from learning_rate down to min_learning_rate at the last step."""
    if optimizer_step < cfg.lr_warmup_steps:
        return cfg.learning_rate * (optimizer_step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    span = max(total_steps - cfg.lr_warmup_steps - 1, 1)
    progress = min((optimizer_step - cfg.lr_warmup_steps) / span, 1.0)
    return cfg.min_learning_rate + (cfg.learning_rate - cfg.min_learning_rate) * 0.5 * (1 + math.cos(math.pi * progress))


def squared_norm(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared gradient norms (of this rank's part of a sharded one), float64, without a float64 copy
    of any gradient."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.nn.utils.get_total_norm(grads).double().square().to(device)


class TrainStep:
    """`optimizer`'s first parameter group is the model's; with a critic, its second is the critic's (its own
    learning rate: `step`'s critic_lr)."""

    def __init__(self, model: MoETransformer, critic: Critic | None, optimizer: torch.optim.Optimizer,
                 *, ep: ExpertParallel | None, world: int, rank: int, device: torch.device, grad_clip: float,
                 bf16: bool, exact: ExactScorer | None = None) -> None:
        """`exact`: the exact numerics mode's scorer (numerics.py), whose values a forward asked for
        `exact_values` takes."""
        self.model, self.critic, self.optimizer, self.exact = model, critic, optimizer, exact
        self.ep, self.world, self.rank, self.device = ep, world, rank, device
        self.grad_clip, self.bf16 = grad_clip, bf16
        # Split across ranks (experts by EP, dense weights by FSDP): each rank adds its part's squared norm to the
        # step's one all-reduce. Replicated (every other weight): summed by EP's all-reduce, then equal everywhere.
        self.split_params = [p for n, p in model.named_parameters() if EXPERT_MARK in n or is_sharded(p)]
        split = set(self.split_params)
        self.replicated_params = [p for p in model.parameters() if p not in split]
        self.critic_params = list(critic.parameters()) if critic is not None else []

    def forward(self, model: MoETransformer, mb: Sequences, *, temperature: float, replay: bool,
                values: bool = False, policy_grad: bool = True, exact_values: bool = False) -> Forward:
        """The micro-batch's sequences packed into one row; log-probabilities of its targets at `temperature`
        straight from the final hidden states (no [tokens, vocabulary] logits kept). Under context parallelism
        this rank runs its slice of the row (padded to a multiple of the group by a sequence of its own) and the
        per-token outputs are gathered from the group, so every rank of it sees the whole micro-batch's.
        `values`: the critic's too; `policy_grad` false runs the model without a graph (the critic's warm-up).
        `exact_values` (the policy at the weights last published, in the exact numerics mode): the logprobs and
        entropies are the exact scorer's bits; where the scorer is `differentiable` its forward is the only one,
        else they come with this forward's gradient."""
        if exact_values and self.exact is not None and self.exact.differentiable:
            return self.exact_forward(mb, temperature=temperature, values=values, policy_grad=policy_grad)
        # The exact scorer's forward first: its transient buffers (its sequences' keys and values, a chunk of
        # logits) are freed before the fast forward's activations, kept for the backward, are made.
        exact = self.exact.logprobs(mb, temperature) if exact_values and self.exact is not None else None
        inputs, targets, lengths = mb.packed_inputs(), mb.packed_targets(), mb.lengths
        routing = mb.packed_routing() if replay else None
        cp, tokens = model.cp, inputs.shape[1]
        if cp is not None:
            pad = -tokens % cp.size
            if pad:
                inputs, targets, lengths = F.pad(inputs, (0, pad)), F.pad(targets, (0, pad)), [*lengths, pad]
                routing = None if routing is None else [F.pad(r, (0, 0, 0, pad)) for r in routing]
            lo, hi = cp.slice_bounds(tokens + pad)
            inputs, targets = inputs[:, lo:hi], targets[lo:hi]
            routing = None if routing is None else [r[:, lo:hi] for r in routing]
        with torch.set_grad_enabled(policy_grad and torch.is_grad_enabled()), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = model(inputs, sequence_lengths=lengths, logits=False, routing_replay=routing)
            hidden = out.hidden[0]
            logp, entropy = token_logprobs_and_entropy(hidden, model.lm_head.weight, targets,
                                                       temperature=temperature)
        if cp is not None:
            logp, entropy = cp.gather(logp)[:tokens], cp.gather(entropy)[:tokens]
        value = kept = None
        if values:
            # Of the whole packed row (the prefix sums need every position before), then this rank's slice; in
            # float32 outside autocast, on detached inputs (critic.py says why).
            features = prefix_features(mb.unpack(logp), mb.mask, self.critic.max_tokens)[mb.valid]
            if cp is not None:
                features = F.pad(features, (0, 0, 0, pad))[lo:hi]
            kept = CriticInputs(hidden.detach().float(), features, tokens)
            value = self.critic_values(mb, kept)
        logp, entropy = mb.unpack(logp), mb.unpack(entropy)
        if exact is not None:
            # Two forwards, where the exact one's gradient cannot reach the policy (numerics.trains_on_the_copy)
            logp, entropy = values_with_gradient(exact[0], logp), values_with_gradient(exact[1], entropy)
        return Forward(logp, entropy, value, out.aux_loss, out.expert_load, kept)

    def exact_forward(self, mb: Sequences, *, temperature: float, values: bool, policy_grad: bool) -> Forward:
        """`forward`'s outputs from the exact scorer's differentiable forward alone (trainer/numerics.py): the
        values are its bits, its gradient is handed to the policy's parameters by its copy's, and the critic reads
        its hidden states."""
        with torch.set_grad_enabled(policy_grad and torch.is_grad_enabled()):
            # where the policy recomputes its layers, they recompute the exact ones' backward (exact_recompute.py)
            run_layer = policy_recompute(self.model, mb.lengths, self.bf16) if checkpointed(self.model) else None
            out = self.exact.forward(mb, temperature, run_layer)
        value = kept = None
        if values:
            features = prefix_features(out.logprobs, mb.mask, self.critic.max_tokens)[mb.valid]
            kept = CriticInputs(out.hidden.detach().float(), features, out.hidden.shape[0])
            value = self.critic_values(mb, kept)
        return Forward(out.logprobs, out.entropy, value, out.aux_loss, out.expert_load, kept)

    def critic_values(self, mb: Sequences, inputs: CriticInputs) -> torch.Tensor:
        """The critic's values [B, S] of the micro-batch from its inputs (under context parallelism this rank's
        slice of them, the values gathered from the group)."""
        value = self.critic(inputs.hidden, inputs.features)
        cp = self.model.cp
        return mb.unpack(value if cp is None else cp.gather(value)[:inputs.tokens])

    @torch.no_grad()
    def score(self, mb: Sequences, *, temperature: float, replay: bool,
              values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's logprobs [B, S] of the micro-batch at the weights last published, and the critic's values
        if asked for (else None): a batch's scoring before its first update. In the exact numerics mode the
        logprobs are the exact scorer's alone; the critic reads the hidden states of its forward (`forward`'s
        exact path), or of the fast forward where the scorer is not `differentiable`: without a critic nothing of
        that forward would be read (its values would be the scorer's bits, and no gradient follows). Every rank
        takes the same path (`values` is the run's, not the micro-batch's), so under expert parallelism the ranks
        still meet in the same forwards."""
        if self.exact is not None and not values:
            return self.exact.logprobs(mb, temperature)[0], None
        fwd = self.forward(self.model, mb, temperature=temperature, replay=replay, values=values, exact_values=True)
        return fwd.logprobs, fwd.values

    def step(self, microbatches: list[Sequences], loss_fn: LossFn, *, lr: float, temperature: float,
             replay: bool, critic_lr: float = 0.0, train_policy: bool = True, exact_values: bool = False,
             keep_critic_inputs: bool = False) -> dict:
        """Accumulate the micro-batches' gradients, sync, clip, step. `train_policy` false steps the critic alone
        (its warm-up: the model runs without a graph, and neither its weights nor its AdamW state change).
        `exact_values`: the forwards' values from the exact scorer (a batch's first step). `keep_critic_inputs`:
        the result holds `critic_inputs`, each micro-batch's (for `critic_step`).
        Returns the metrics summed over micro-batches and ranks, plus `grad_norm` (the policy's, before
        clipping), `critic_grad_norm` (with a critic), `arrivals` (each rank's seconds to the gradient sync),
        `expert_load` [L, E] (all ranks)."""
        started = time.monotonic()
        sums: dict[str, float] = {}
        load, kept = None, []
        for j, mb in enumerate(microbatches):
            fwd = self.forward(self.model, mb, temperature=temperature, replay=replay,
                               values=self.critic is not None, policy_grad=train_policy,
                               exact_values=exact_values)
            loss, metrics = loss_fn(j, mb, fwd)
            metrics["loss"] = float(loss.detach())
            if self.model.cp is not None:
                # Every rank of a CP group computed the whole micro-batch's loss from the gathered outputs; the
                # gather's backward sums the group's gradients into each slice, and the step sums over ranks.
                loss = loss / self.model.cp.size
                metrics = {key: value / self.model.cp.size for key, value in metrics.items()}
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
            load = fwd.expert_load.double() if load is None else load + fwd.expert_load
            if keep_critic_inputs:  # else each micro-batch's float32 hidden states would live to the step's end
                kept.append(fwd.critic_inputs)
        arrived = time.monotonic() - started
        replicated = [*(self.replicated_params if train_policy else []), *self.critic_params]
        if self.ep is not None:
            self.ep.sum_replicated_grads(replicated)
        split_sq = squared_norm(self.split_params, self.device)
        keys = sorted(sums)
        arrivals = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        arrivals[self.rank] = arrived
        # The one collective: loss terms, the split weights' squared gradient norm (each rank holds other experts
        # and other shards; replicated gradients are equal everywhere after the sync), arrivals, expert load.
        packed = torch.cat([torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device),
                            split_sq.reshape(1), arrivals, load.reshape(-1).to(self.device)])
        if self.world > 1:
            dist.all_reduce(packed)
        n = len(keys)
        norm = torch.sqrt(packed[n] + squared_norm(self.replicated_params, self.device))
        # Each clipped by its own norm: the value loss's gradient (large while the critic is far off) would
        # otherwise shrink the policy's through the shared clip.
        clipped = [(norm, self.split_params + self.replicated_params)]
        if self.critic is not None:
            critic_norm = torch.sqrt(squared_norm(self.critic_params, self.device))
            clipped.append((critic_norm, self.critic_params))
        for total, params in clipped:
            clip_to(total, params, self.grad_clip)
        self.optimizer.param_groups[0]["lr"] = lr
        if self.critic is not None:
            self.optimizer.param_groups[1]["lr"] = critic_lr
        self.optimizer.step()  # AdamW skips a parameter without a gradient: the frozen policy's, in warm-up
        self.optimizer.zero_grad(set_to_none=True)
        result = dict(zip(keys, packed[:n].tolist()))
        result.update(grad_norm=float(norm), lr=lr, arrivals=packed[n + 1:n + 1 + self.world].tolist(),
                      expert_load=packed[n + 1 + self.world:].view_as(load).float().cpu())
        if self.critic is not None:
            result.update(critic_grad_norm=float(critic_norm), critic_lr=critic_lr)
        if keep_critic_inputs:
            result["critic_inputs"] = kept
        return result

    def critic_step(self, microbatches: list[Sequences], inputs: list[CriticInputs], loss_fn: ValueLossFn, *,
                    critic_lr: float) -> dict:
        """One optimizer step of the critic alone on the inputs a forward kept (`step`'s critic_inputs): no
        forward of the model, whose weights and AdamW state stay untouched (AdamW skips a parameter without a
        gradient). Its collectives, the gradient sync and one all-reduce of the metrics, run on every rank the
        same number of times. Returns the metrics summed over micro-batches and ranks, plus `critic_grad_norm`."""
        sums: dict[str, float] = {}
        for j, (mb, kept) in enumerate(zip(microbatches, inputs)):
            loss, metrics = loss_fn(j, mb, self.critic_values(mb, kept))
            if self.model.cp is not None:  # as in `step`: every rank of the group computed the whole loss
                loss = loss / self.model.cp.size
                metrics = {key: value / self.model.cp.size for key, value in metrics.items()}
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        if self.ep is not None:
            self.ep.sum_replicated_grads(self.critic_params)
        keys = sorted(sums)
        packed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(packed)
        norm = torch.sqrt(squared_norm(self.critic_params, self.device))
        clip_to(norm, self.critic_params, self.grad_clip)
        self.optimizer.param_groups[1]["lr"] = critic_lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**dict(zip(keys, packed.tolist())), "critic_grad_norm": float(norm)}


@torch.no_grad()
def clip_to(norm: torch.Tensor, params: list[torch.Tensor], max_norm: float) -> None:
    """Scale the gradients of `params`, whose global norm is `norm`, down to `max_norm`: torch's
    clip_grads_with_norm_ on the local tensors (its foreach kernels take no mix of DTensors and tensors); the same
    coefficient and product, so replicated layouts step bitwise as before."""
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = local(p.grad)
            grad.mul_(coefficient.to(grad.device))
