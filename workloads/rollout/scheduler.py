"""The scheduler: which rows run in a step. It queues rows, admits them into free row slots and KV-cache blocks
(a context's consecutive rows as one group that shares one prefill and the prompt's full blocks), plans a step's
prefill chunk and decode rows, preempts the newest decoding rows when blocks run out, and books what the model
runner sampled: tokens, logprobs, finished rows and the slots and blocks they return. Host state only; the runner
does the device work."""
from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..rl.protocol import VersionSpan
from .engine_api import RowOutput, RowRequest, SamplingParams
from .kv_cache_manager import PagedCache

if TYPE_CHECKING:  # the runner's records; the runner imports this module's
    from .model_runner import PromptScores, SampledRows

log = logging.getLogger(__name__)


def _admission(seq: "Sequence") -> int:
    return seq.admitted


@dataclass(eq=False)
class Sequence:
    """One row in the decoder: its request, where it lives, what it produced."""

    request: RowRequest
    seed: int  # the resolved seed (fresh entropy when the request had none)
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    routing: torch.Tensor | None = None  # [positions, layers, k] on the device, kept when the row finishes
    admitted: int = 0  # admission order (the newest decoding row is preempted first)
    preempted: int = 0  # times its blocks were taken back and it was queued to be recomputed
    prompt_logprobs: list[float | None] | None = None  # with params.prompt_logprobs, once its prefill ended
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # the weights of its tokens, in order (weights_of): [lineage, version, tokens] each, the last one counted up in
    # place (a row's every token passes here: a new record per token cost a measurable part of a step's host time)
    versions: list[list[int]] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def context(self) -> tuple[int, ...]:
        """What a prefill feeds: the prompt, and after a preemption the tokens sampled so far (the last of them
        not fed yet: prefilling it samples the next token, as the decode step would have)."""
        return self.request.prompt_ids + tuple(self.tokens)

    def weights_of(self, lineage: int, version: int) -> None:
        """Its newest token was sampled with weights (lineage, version): the last span grows, or a new one begins
        (the replica's weights were swapped while it ran)."""
        last = self.versions[-1] if self.versions else None
        if last is not None and last[1] == version and last[0] == lineage:
            last[2] += 1
        else:
            self.versions.append([lineage, version, 1])

    @property
    def spans(self) -> list[VersionSpan]:
        return [VersionSpan(*v) for v in self.versions]

    def output(self, version: int | None, lineage: int | None) -> RowOutput:
        """The finished row as the engine reports it; its routing leaves the device here, as [positions, layers,
        k]."""
        routing = self.routing.cpu().numpy() if self.routing is not None else None
        return RowOutput(self.request.request_id, self.request.row, list(self.tokens), list(self.logprobs),
                         self.top_logprobs, self.finish_reason, self.error, routing, version, lineage or 0,
                         self.prompt_logprobs, self.prompt_top_logprobs, self.spans)


@dataclass(eq=False)
class SharedPrefill:
    """Rows admitted together with one context (a prompt): the leader's slot is prefilled; the others share its
    full blocks and copy its partial last one."""

    rows: list[Sequence]
    prefilled: int = 0  # context tokens in the leader's cache so far
    # when a row asked for them: the logprobs of prompt tokens 1.. (and their alternatives), chunk by chunk
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def context(self) -> tuple[int, ...]:
        return self.rows[0].context


@dataclass
class PrefillPlan:
    """A step's prefill chunk: (group, context tokens it feeds now) in order, and which chunks (indexes) score
    their prompt tokens (a row asked for prompt logprobs)."""

    chunks: list[tuple[SharedPrefill, int]]
    scored: list[int]


@dataclass
class DecodePlan:
    """A step's decode rows (oldest first) and the attention bound of an eager step (the longest length + 1)."""

    rows: list[Sequence]
    key_len: int


@dataclass
class StepEvents:
    """What one step produced: per row that sampled, (row, token, logprob, top alternatives); rows that
    finished (finish_reason set, slot freed)."""

    sampled: list[tuple[Sequence, int, float, list[tuple[int, float]] | None]]
    finished: list[Sequence]


class Scheduler:
    """Rows waiting, prefilling and decoding over `cache`'s slots and blocks. Admission needs the blocks of a row's
    prompt and leaves those the decoding rows take next; when decoding rows still need more blocks than are free,
    the newest rows are preempted: their blocks are returned and they wait at the head of the queue to be prefilled
    again (prompt + tokens so far) and continue where they were."""

    def __init__(self, cache: PagedCache, *, eos_ids: Iterable[int], vocab_size: int, prefill_tokens: int) -> None:
        self.cache, self.eos_ids, self.vocab_size = cache, frozenset(eos_ids), vocab_size
        self.prefill_tokens = prefill_tokens
        self.free = list(range(cache.scratch - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[SharedPrefill] = []
        self.decoding: list[Sequence] = []  # rows whose last sampled token is still to be fed
        # rows of a decode step launched before the previous step's tokens were booked (plan_ahead): their
        # positions are counted in `length`, their tokens not yet in `tokens`
        self.in_flight: list[Sequence] = []
        self.length = [0] * (cache.scratch + 1)  # positions filled per slot (host copy of what the cache holds)
        self.preemptions = 0
        self._admissions = 0

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def running(self) -> int:
        return sum(len(g.rows) for g in self.prefilling) + len(self.decoding) + len(self.in_flight)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.in_flight)

    def add(self, request: RowRequest) -> Sequence:
        """Queue a row; it is admitted when a slot and its prompt's blocks are free. Raises ValueError if it can
        never fit."""
        need = len(request.prompt_ids) + 1
        if need > self.max_len:
            raise ValueError(f"prompt_ids: {len(request.prompt_ids)} tokens; this engine holds at most "
                             f"{self.max_len - 1} prompt tokens per row")
        longest = self.cache.blocks_for(min(len(request.prompt_ids) + request.params.max_tokens, self.max_len))
        if longest > self.cache.blocks:
            raise ValueError(f"max_tokens: {request.params.max_tokens} with {len(request.prompt_ids)} prompt tokens "
                             f"needs {longest} KV-cache blocks of {self.cache.block_size} positions; this engine "
                             f"has {self.cache.blocks}")
        if max(request.prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt_ids: token id {max(request.prompt_ids)} is outside [0, {self.vocab_size})")
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(64)
        seq = Sequence(request, seed, request.params.stop_ids(self.eos_ids),
                       top_logprobs=[] if request.params.top_logprobs else None)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> bool:
        """Finish `seq` with "abort" if it has not finished; True if it was still going. A cancelled row in a
        group's shared prefill keeps its slot until that prefill ends (the others still need it)."""
        if seq.finish_reason is not None:
            return False
        seq.finish_reason = "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.decoding:
            self.decoding.remove(seq)
            self.release(seq)
        elif seq in self.in_flight:  # its launched step's token is dropped when that step is booked
            self.release(seq)
        else:
            for group in self.prefilling:
                if all(r.finish_reason is not None for r in group.rows):
                    self.prefilling.remove(group)
                    for r in group.rows:
                        self.release(r, keep_routing=False)
                    break
        return True

    # ---- admission -----------------------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Move waiting rows into free slots, in order, a context's consecutive rows as one group (one prefill):
        the leader gets its context's blocks, each other row shares the full ones and gets a block for a copy of
        the partial last one. Stops at the first row whose blocks are not free, leaving the blocks that the decoding
        rows take at their next step (so an admission does not preempt them). Returns the rows admitted."""
        admitted: list[Sequence] = []
        if not (self.waiting and self.free):
            return admitted
        cache = self.cache
        spare = sum(map(self._needs_block, self.decoding)) + sum(map(self._needs_block, self.in_flight))
        while self.waiting and self.free:
            context = self.waiting[0].context
            full, partial = divmod(len(context), cache.block_size)
            group = SharedPrefill([])
            while self.waiting and self.free and self.waiting[0].context == context:
                need = (full + (partial > 0)) if not group.rows else int(partial > 0)
                if len(cache.free) < need + spare:
                    break
                seq = self.waiting.popleft()
                seq.slot = self.free.pop()
                self._admissions += 1
                seq.admitted = self._admissions
                self.length[seq.slot] = 0
                if group.rows:
                    cache.share(group.rows[0].slot, seq.slot, full)
                cache.grow(seq.slot, len(context))
                group.rows.append(seq)
            if not group.rows:
                break
            self.prefilling.append(group)
            admitted += group.rows
            if self.waiting and self.waiting[0].context == context:  # the group was cut short by blocks
                break
        return admitted

    # ---- prefill -------------------------------------------------------------------------------------------
    def plan_prefill(self) -> PrefillPlan:
        """Up to `prefill_tokens` context tokens of the prefilling groups, in order."""
        budget, chunks = self.prefill_tokens, []
        for group in self.prefilling:
            take = min(len(group.context) - group.prefilled, budget)
            if take <= 0:
                break
            chunks.append((group, take))
            budget -= take
        scored = [i for i, (g, _) in enumerate(chunks)
                  if any(r.params.prompt_logprobs and r.prompt_logprobs is None for r in g.rows)]
        return PrefillPlan(chunks, scored)

    def prefilled(self, plan: PrefillPlan, scores: list[PromptScores]) -> tuple[list[Sequence], list[int]]:
        """Book a prefill chunk the runner fed (`scores`: of the plan's scored chunks): groups whose context is in
        the cache leave prefilling, their other rows copy the leader's partial last block. Returns the rows that
        sample their next token now and the chunk (index) whose logits they sample from."""
        for i, score in zip(plan.scored, scores):
            group = plan.chunks[i][0]
            group.prompt_logprobs += score.logprobs
            group.prompt_top_logprobs += score.top
        done = []
        for i, (group, take) in enumerate(plan.chunks):
            group.prefilled += take
            self.length[group.rows[0].slot] = group.prefilled
            if group.prefilled == len(group.context):
                done.append((group, i))
        rows, which = [], []
        for group, i in done:
            self.prefilling.remove(group)
            leader, length = group.rows[0].slot, group.prefilled
            full, partial = divmod(length, self.cache.block_size)
            for r in group.rows:
                if partial and r.slot != leader:
                    self.cache.copy_block(leader, r.slot, full)
                self.length[r.slot] = length
                if r.params.prompt_logprobs and r.prompt_logprobs is None:  # (a recomputed row has them)
                    # the first prompt token has nothing before it to be scored on
                    n = r.params.top_logprobs
                    r.prompt_logprobs = [None, *group.prompt_logprobs]
                    r.prompt_top_logprobs = [None, *(alts[:n] for alts in group.prompt_top_logprobs)] if n else None
                if r.finish_reason is None:
                    rows.append(r)
                    which.append(i)
                else:  # cancelled while its group prefilled
                    self.release(r, keep_routing=False)
        return rows, which

    # ---- decode --------------------------------------------------------------------------------------------
    def plan_decode(self) -> DecodePlan:
        """Every row with a token to feed, each granted the block its next position needs; while more rows need
        one than blocks are free, the newest row is preempted."""
        cache, length, page, owned = self.cache, self.length, self.cache.block_size, self.cache.owned
        rows = sorted(self.decoding, key=_admission)
        self.decoding = []
        # a row's next position starts a block it does not hold yet (_needs_block, inlined: every row, every step)
        needing = [r for r in rows if length[r.slot] >= len(owned[r.slot]) * page]
        if len(needing) > len(cache.free):
            needing = {id(r) for r in needing}
            while rows and len(needing) > len(cache.free):
                victim = rows.pop()
                needing.discard(id(victim))
                self._preempt(victim)
            needing = [r for r in rows if id(r) in needing]
        for r in needing:
            cache.grow(r.slot, length[r.slot] + 1)
        return DecodePlan(rows, max((length[r.slot] for r in rows), default=0) + 1)

    def plan_ahead(self, running: list[Sequence]) -> DecodePlan | None:
        """The next decode step, planned while `running` (a launched step's rows) are still on the device: the rows
        of it that continue whatever they sample (below their max_tokens and max_len after it; a stop token is
        seen only when that step is booked: such a row's next token is then dropped), with the rows that finished
        their prefill, each granted the block its next position needs. None when blocks are short (the next
        step is planned once this one is booked, and may preempt)."""
        length, max_len, page, owned = self.length, self.max_len, self.cache.block_size, self.cache.owned
        self.in_flight = []  # `running` is booked next: only the step planned here will be in flight
        rows = [r for r in running if r.finish_reason is None and len(r.tokens) + 1 < r.request.params.max_tokens
                and length[r.slot] < max_len] + self.decoding
        needing = [r for r in rows if length[r.slot] >= len(owned[r.slot]) * page]
        if not rows or len(needing) > len(self.cache.free):
            return None
        for r in needing:
            self.cache.grow(r.slot, length[r.slot] + 1)
        rows.sort(key=_admission)
        self.decoding, self.in_flight = [], list(rows)  # (a cancel takes a row out of it, not out of the plan)
        return DecodePlan(rows, max(length[r.slot] for r in rows) + 1)

    def rewind(self) -> list[Sequence]:
        """Undo the launched step of the rows in flight (its tokens are dropped: new weights were installed under
        it): they feed their last token again at the next step. Returns them."""
        rows, self.in_flight = [r for r in self.in_flight if r.finish_reason is None], []
        for r in rows:
            self.length[r.slot] -= 1
        self.decoding += rows
        return rows

    def decoded(self, plan: DecodePlan) -> None:
        """The runner fed the plan's rows one position each."""
        length = self.length
        for r in plan.rows:
            length[r.slot] += 1

    def _needs_block(self, seq: Sequence) -> bool:
        """Whether a decoding row's next position starts a block it does not hold yet."""
        return self.length[seq.slot] >= len(self.cache.owned[seq.slot]) * self.cache.block_size

    def _preempt(self, seq: Sequence) -> None:
        """Take a decoding row's blocks back; it waits at the head of the queue to be recomputed."""
        log.info("KV cache full: row %s/%d preempted after %d tokens; it is recomputed when blocks free up",
                 seq.request.request_id, seq.request.row, len(seq.tokens))
        self.release(seq, keep_routing=False)
        seq.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # ---- what the runner sampled -----------------------------------------------------------------------------
    def sampled(self, rows: list[Sequence], sampled: SampledRows, events: StepEvents) -> None:
        """Book each row's new token; a row that sampled a stop token or reached its length finishes and returns
        its slot and blocks, the others decode at the next step (or are already in it: in flight). A row that
        finished while its step ran (cancelled, or a stop token booked after the step was launched) drops it.
        (Every running row passes here every step: the loop keeps its lookups local.)"""
        tops = sampled.top or [None] * len(rows)
        length, max_len, decoding, events_sampled = self.length, self.max_len, self.decoding, events.sampled
        ahead = {id(r) for r in self.in_flight}
        for r, token, logprob, top in zip(rows, sampled.tokens, sampled.logprobs, tops):
            if r.finish_reason is not None:
                continue
            if top is not None:
                r.top_logprobs.append(top)
            r.tokens.append(token)
            r.logprobs.append(logprob)
            events_sampled.append((r, token, logprob, top))
            if token in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.request.params.max_tokens or length[r.slot] >= max_len:
                r.finish_reason = "length"
            if r.finish_reason is None:
                if id(r) not in ahead:
                    decoding.append(r)
            else:
                events.finished.append(r)
                self.release(r)

    def release(self, seq: Sequence, keep_routing: bool = True) -> None:
        """Free a row's slot and blocks; first keep (on the device) the expert ids of its fed positions,
        prompt + completion[:-1], if it asked for them."""
        if seq.slot is None:
            return
        fed = self.length[seq.slot]
        if seq in self.in_flight:  # finished while a launched step fed its last token: that position is not its own
            self.in_flight.remove(seq)
            fed -= 1
        if keep_routing and seq.params.return_routing:
            seq.routing = self.cache.routing_of(seq.slot, fed)
        self.cache.release(seq.slot)
        self.free.append(seq.slot)
        seq.slot = None
