"""Batched sampling with a KV cache: several requests' rows decode together (left-padded prompts, one forward per
token for the whole batch). Each row samples from its own seeded generator, so a row's tokens depend on its seed
and the weights, not on which other rows shared its batch (up to floating-point reduction order)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model import KVCache, MoETransformer


@dataclass
class Row:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    want_routing: bool = False


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # ended with end-of-sequence (else cut off at max_tokens)
    # per MoE layer, per fed position (prompt, then completion tokens but the last), the expert ids
    routing: list[list[list[int]]] | None = None


def sample(logits: torch.Tensor, rows: list[Row], generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """logits [B, V] -> per row (token, its log-probability under the temperature-scaled distribution before
    top-p); the trainer scores tokens under that same distribution. temperature 0 = greedy (logprob at
    temperature 1). One pass over the batch on the logits' device; a row's only randomness is one uniform from
    its own seeded generator (inverse-CDF sampling), so its draw does not depend on the other rows."""
    logits = logits.float()
    device = logits.device
    temperature = torch.tensor([r.temperature or 1.0 for r in rows], device=device)[:, None]
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if any(r.top_p < 1 for r in rows):  # keep the smallest prefix of the sorted distribution whose mass reaches top_p
        top_p = torch.tensor([r.top_p for r in rows], device=device)[:, None]
        sorted_p, order = probs.sort(-1, descending=True)
        kept = (sorted_p.cumsum(-1) - sorted_p < top_p) | (top_p >= 1)
        # The cut is applied in vocabulary order, so a row's draw does not depend on whether others needed one.
        probs = probs * torch.zeros_like(kept).scatter(-1, order, kept)
    cdf = probs.cumsum(-1)
    u = torch.tensor([float(torch.rand(1, generator=g)) for g in generators], device=device)[:, None]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=logits.shape[-1] - 1)
    greedy = torch.tensor([r.temperature == 0 for r in rows], device=device)[:, None]
    tokens = torch.where(greedy, logits.argmax(-1, keepdim=True), tokens)
    return tokens[:, 0].tolist(), logp.gather(-1, tokens)[:, 0].tolist()


@torch.no_grad()
def generate(model: MoETransformer, rows: list[Row], eos_id: int, pad_id: int = 0, *, steps: int | None = None,
             any_active: Callable[[bool], bool] = bool) -> list[RowResult]:
    """Decode `rows` together. On an expert-parallel server each rank decodes its own rows and every forward
    exchanges tokens with the other ranks, so they must run the same number of forwards: `steps` is then the
    largest max_tokens over every rank's rows and `any_active` says whether any rank still has a row decoding."""
    b = len(rows)
    prompt_len = max(len(r.prompt) for r in rows)
    steps = max(r.max_tokens for r in rows) if steps is None else steps
    device = next(model.parameters()).device
    # A group's rows (GRPO samples n completions of one prompt) share their prompt: each distinct prompt is
    # prefilled once and every row starts from a copy of its prompt's cache.
    distinct: dict[tuple[int, ...], int] = {}
    source = torch.tensor([distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows], device=device)
    ids = torch.full((len(distinct), prompt_len), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(distinct), prompt_len, dtype=torch.bool, device=device)
    for i, prompt in enumerate(distinct):
        ids[i, prompt_len - len(prompt):] = torch.tensor(prompt)
        mask[i, prompt_len - len(prompt):] = True
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    dtype = next(model.parameters()).dtype
    prefill = KVCache.allocate(model.config, len(distinct), prompt_len, device, dtype)
    want_routing = any(r.want_routing for r in rows)
    out = model(ids, positions=positions, kv_cache=prefill, attention_mask=mask, return_routing=want_routing)
    cache = KVCache.allocate(model.config, b, prompt_len + steps, device, dtype)
    cache.take_prefix(prefill, source)
    del prefill
    mask, positions = mask[source], positions[source]
    generators = []
    for r in rows:
        g = torch.Generator(device="cpu")
        g.manual_seed(r.seed) if r.seed is not None else g.seed()
        generators.append(g)
    results = [RowResult(routing=[[] for _ in range(model.config.num_hidden_layers)] if r.want_routing else None)
               for r in rows]
    # Decoding feeds only the rows in `live` (indices into `rows`); routing_steps keeps which rows each step had.
    live = list(range(b))
    routing_steps = [([layer[source] for layer in out.routing], mask, live)] if want_routing else []
    logits = out.logits[:, -1][source]
    next_pos = positions[:, -1] + 1

    def decoding(i: int) -> bool:
        return not results[i].finished and len(results[i].tokens) < rows[i].max_tokens

    for step in range(steps):
        # The live rows still decoding sample together on the device; their tokens and logprobs come down once.
        fed = [pad_id] * len(live)
        todo = [j for j, i in enumerate(live) if decoding(i)]
        if todo:
            picked = logits if len(todo) == len(live) else logits[torch.tensor(todo, device=device)]
            tokens, logprobs = sample(picked, [rows[live[j]] for j in todo], [generators[live[j]] for j in todo])
            for j, token, logprob in zip(todo, tokens, logprobs):
                res = results[live[j]]
                res.tokens.append(token)
                res.logprobs.append(logprob)
                res.finished = token == eos_id
                fed[j] = token
        active = [j for j in todo if decoding(live[j])]
        if not any_active(bool(active)) or step == steps - 1:
            break
        if len(active) <= len(live) // 2:
            # Drop the finished rows once they are half the batch: each copy of the cache is at most half the
            # last, so the copies cost less than one more cache, while every later step computes only live rows.
            keep = torch.tensor(active, dtype=torch.long, device=device)
            cache, next_pos = cache.keep_rows(keep), next_pos[keep]
            live, fed = [live[j] for j in active], [fed[j] for j in active]
        out = model(torch.tensor(fed, dtype=torch.long, device=device)[:, None], positions=next_pos[:, None],
                    kv_cache=cache, return_routing=want_routing)
        if want_routing:
            routing_steps.append((out.routing, torch.ones(len(live), 1, dtype=torch.bool), live))
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    if want_routing:
        _collect_routing(rows, results, routing_steps)
    return results


def _collect_routing(rows: list[Row], results: list[RowResult], steps) -> None:
    """Keep, per row, the routing of the positions the trainer will feed: its prompt and completion[:-1]. Each
    step's ids come to the host once, as one tensor."""
    for routing, valid, live in steps:
        ids, valid = torch.stack(routing).cpu(), valid.cpu()  # [layers, live rows, positions, k]
        for j, i in enumerate(live):
            if rows[i].want_routing:
                for layer, kept in enumerate(ids[:, j][:, valid[j]].tolist()):
                    results[i].routing[layer].extend(kept)
    for r, res in zip(rows, results):
        if r.want_routing:
            wanted = len(r.prompt) + len(res.tokens) - 1
            res.routing = [layer[:wanted] for layer in res.routing]
