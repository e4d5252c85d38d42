"""Training samples as tensors: per-token tensors padded to [B, S] (what the losses read), the packed row the
model runs on (sequences back to back, no padding: model/transformer.py's `sequence_lengths`), how a batch's samples
are shared among trainer ranks (balanced by tokens), and the plan that splits a rank's share of a mini-batch into
micro-batches under a token budget."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, Sequence

import torch

from ..rl.protocol import RoutingRef

# (a sample's routing reference, its field path for errors) -> its expert ids [positions, layers, k] (numpy)
ReadRouting = Callable[[RoutingRef, str], Any]


class TrainingSequence(Protocol):
    """What a sample must have to be trained on (protocol.TrainingSample has it)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float
    routing: RoutingRef | None


def sequence_tokens(sample: TrainingSequence) -> int:
    """Tokens a sample puts through the model: prompt + completion[:-1]."""
    return len(sample.prompt_ids) + len(sample.completion_ids) - 1


@dataclass
class Sequences:
    """B samples, right-padded to S = the longest. Rows' real tokens are a prefix, so the row-major order of
    `valid` is the packed order."""

    inputs: torch.Tensor  # [B, S] prompt + completion[:-1]
    targets: torch.Tensor  # [B, S] the next tokens
    mask: torch.Tensor  # [B, S] float, 1 on completion targets
    valid: torch.Tensor  # [B, S] bool, real tokens
    behaviour: torch.Tensor  # [B, S] rollout logprobs on completion targets
    advantages: torch.Tensor  # [B] sequence advantages from the orchestrator
    rewards: torch.Tensor  # [B]
    routing: torch.Tensor | None  # [L, B, S, k] expert ids for routing replay

    @classmethod
    def of(cls, samples: Sequence[TrainingSequence], read_routing: ReadRouting | None = None) -> "Sequences":
        """With `read_routing` (routing replay), each sample's routed experts are read through it: only the
        samples given, so a trainer rank reads its own share of a batch's routing and nothing else."""
        b = len(samples)
        width = max((sequence_tokens(s) for s in samples), default=0)
        inputs, targets = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, width, dtype=torch.long)
        mask, behaviour = torch.zeros(b, width), torch.zeros(b, width)
        valid = torch.zeros(b, width, dtype=torch.bool)
        routing = None
        for i, s in enumerate(samples):
            seq, n, p = s.prompt_ids + s.completion_ids, sequence_tokens(s), len(s.prompt_ids)
            inputs[i, :n], targets[i, :n] = torch.tensor(seq[:-1]), torch.tensor(seq[1:])
            valid[i, :n] = True
            mask[i, p - 1:n] = 1.0
            behaviour[i, p - 1:n] = torch.tensor(s.logprobs)
            if read_routing is not None and s.routing is not None:
                ids = torch.from_numpy(read_routing(s.routing, f"samples[{i}].routing").astype("int64"))  # [n, L, k]
                if ids.shape[0] != n:
                    raise ValueError(f"sample {i}: routing covers {ids.shape[0]} positions; prompt + completion - 1 "
                                     f"is {n}")
                if routing is None:
                    routing = torch.zeros(ids.shape[1], b, width, ids.shape[2], dtype=torch.long)
                routing[:, i, :n] = ids.permute(1, 0, 2)
        return cls(inputs, targets, mask, valid, behaviour, torch.tensor([float(s.advantage) for s in samples]),
                   torch.tensor([float(s.reward) for s in samples]), routing)

    @property
    def lengths(self) -> list[int]:
        return self.valid.sum(dim=1).tolist()

    def select(self, rows: list[int]) -> "Sequences":
        """These rows, trimmed to their longest sequence."""
        index = torch.tensor(rows, dtype=torch.long, device=self.inputs.device)
        width = int(self.valid[index].sum(dim=1).max()) if rows else 0
        cut = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, t in cut.items():
            if t is None:
                continue
            if name == "routing":
                cut[name] = t[:, index, :width]
            elif t.dim() == 2:
                cut[name] = t[index, :width]
            else:
                cut[name] = t[index]
        return Sequences(**cut)

    def to(self, device: torch.device) -> "Sequences":
        return Sequences(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                            for f in fields(self)})

    def packed_inputs(self) -> torch.Tensor:
        """[1, T]: the real tokens of every row, back to back."""
        return self.inputs[self.valid].unsqueeze(0)

    def packed_targets(self) -> torch.Tensor:
        return self.targets[self.valid]

    def packed_routing(self) -> list[torch.Tensor] | None:
        """Per layer [1, T, k], or None without routing replay data."""
        return None if self.routing is None else [r[self.valid].unsqueeze(0) for r in self.routing]

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[T] in packed order -> [B, S], zero on padding (differentiable)."""
        return torch.zeros(self.valid.shape, dtype=flat.dtype, device=flat.device).masked_scatter(self.valid, flat)


def plan_microbatches(token_counts: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the sequences each micro-batch packs, at most `max_tokens` tokens each: first fit, longest
    first (few micro-batches, each full), indices ascending inside a micro-batch. A sequence longer than the
    budget is refused: it is never split (the run check keeps the budget above the longest possible sample)."""
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        n = token_counts[i]
        if n > max_tokens:
            raise ValueError(f"a sample of {n} tokens exceeds rl.training.max_tokens_per_microbatch ({max_tokens})")
        for k, (used, members) in enumerate(bins):
            if used + n <= max_tokens:
                bins[k] = (used + n, members + [i])
                break
        else:
            bins.append((n, [i]))
    return [sorted(members) for _, members in bins]


def rank_shares(token_counts: list[int], ranks: int) -> list[list[int]]:
    """Indices of the samples each of `ranks` trainer ranks trains on, balanced by tokens (a step lasts as long as
    its busiest rank): longest first, each to the rank with the fewest tokens so far (then the fewest samples, then
    the lowest rank): the greedy longest-processing-time partition, within 4/3 of the best possible busiest rank.
    Deterministic, so every rank computes the same split of the same batch without talking; indices ascending
    inside a share. A rank may get no sample (more ranks than samples)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], len(shares[r]), r))
        shares[r].append(i)
        loads[r] += token_counts[i]
    return [sorted(share) for share in shares]
