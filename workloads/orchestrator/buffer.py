"""The group buffer: which prompts may be asked for, which scored groups wait, which batch each step gets.

Pure: no I/O, no clock, no lock (its owner, the orchestrator's event loop, is its only caller). Its state is
what a checkpoint records (`snapshot`/`restore`).

- Staleness budget (AReaL's rule): no new prompt while consumed + buffered + in flight groups would exceed
  (trainer version + max_staleness + 1) x prompts_per_step; max_staleness 0 is synchronous on-policy training.
- A group trains step `s` of lineage `L` only if the weights of every token of every sample are in L's history
  (their own lineage, or an older one up to where L forked from it) and `0 <= s - v <= max_staleness` for each
  token's version `v` (protocol.tokens_trainable: the oldest token bounds a sample's staleness); others are dropped
  at batch time and counted. A group is kept or dropped whole: its advantages compare its samples.
- Batches are idempotent by step (a restarted trainer gets the batch its dead predecessor fetched, if every
  sample of it is in the new lineage's history; else it and every later batch are dropped and re-formed), in
  prompt order (which rank trains which sample must not depend on timing).
- Catch-up (`catch_up`): a state restored from a checkpoint older than its trainer (the orchestrator's own file
  lost) takes the trainer's record of the request ids it trained at each step it lacks; those prompts leave what
  waits or are skipped when drawn (`trained_ahead`), so no prompt trains twice and the batches go on at the
  trainer's step.
- Routing replay: samples hold references to their routed experts (protocol.RoutingRef), never the arrays, so
  the buffer's memory does not grow with the routing's size. A reference nothing will train any more goes to
  `released` (its owner deletes the objects: routing_store.py says when).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..rl.protocol import (STATE_FORMAT, WIRE_FORMAT, Batch, BatchStats, Group, OrchestratorState, PromptRecord,
                          RoutingRef, TrainingSample, VersionRef, VersionSpan, prompt_index, request_id, request_of,
                          sample_id, sample_staleness, tokens_trainable)

COUNTS = ("completed", "dropped_stale_groups", "filtered_groups", "dropped_failed_groups", "rewards_failed",
          "retries", "hedges", "deadline_misses", "duplicates_ignored", "failed_requests", "restarts",
          "caught_up_steps")


class StepConflict(ValueError):
    """A trainer asked for a step that is neither batched nor the next one (or handed a record of trained batches
    that does not fit this state)."""


class RecordGap(StepConflict):
    """A trainer's record of trained batches begins after this state ends: the steps between are known to neither
    (a state older than the trainer's record: a newer checkpoint's state can be caught up instead)."""


class MalformedRecord(ValueError):
    """A trainer's record of trained batches names something that is no request id of this orchestrator's."""


@dataclass
class CaughtUp:
    """What a catch-up did: the next batch to form, and the waiting work it took away because a trainer trained
    those prompts already (requests in flight, to cancel; buffered groups)."""

    next_step: int
    cancelled: list[str] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)


@dataclass
class Outcome:
    """What became of a completed group: `kept`, or why not."""

    kind: str  # kept | duplicate | filtered | too_few
    group: Group


@dataclass
class GroupBuffer:
    prompts_per_step: int
    max_staleness: int
    correct_reward: float  # a sample scoring at least this counts as correct in the batch's accuracy
    next_prompt: int = 0
    consumed: int = 0
    first_step: int | None = None  # the step of the first batch (a trainer may start at a checkpoint's)
    trainer: VersionRef | None = None  # the trainer's newest posted version; None until it posts one
    previous: VersionRef | None = None  # the trainer's version before a restart: where a new lineage forks
    forks: dict[int, VersionRef] = field(default_factory=dict)
    in_flight: dict[str, PromptRecord] = field(default_factory=dict)
    buffered: list[Group] = field(default_factory=list)
    batches: dict[int, Batch] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    released: list[RoutingRef] = field(default_factory=list)  # routing no sample will train: for deletion
    trained_ahead: set[int] = field(default_factory=set)  # prompt indices to skip when drawn (catch_up)

    # ---- routing references ---------------------------------------------------------------------------------
    def release(self, samples) -> None:
        """These samples (Sample or TrainingSample) will never train (again): their routing may go."""
        self.released += [s.routing for s in samples if s.routing is not None]

    def _release_groups(self, groups: list[Group]) -> None:
        for g in groups:
            self.release(g.samples)

    def live_routing(self) -> dict[str, RoutingRef]:
        """Every routing reference the state holds (waiting groups, batches not yet checkpointed), by key."""
        samples = [s for g in self.buffered for s in g.samples] + [s for b in self.batches.values() for s in b.samples]
        return {s.routing.key: s.routing for s in samples if s.routing is not None}

    def take_released(self) -> list[RoutingRef]:
        released, self.released = self.released, []
        return released

    # ---- issuing --------------------------------------------------------------------------------------------
    def budget_left(self) -> int:
        """New prompts the staleness budget allows now (0 before the trainer has posted a version). Counted from
        the first batch's step (a trainer may start at a checkpoint's), and never for a version past the next
        batch to form: a trainer cannot have trained a batch not yet formed, so a version post beyond it (a
        hostile or confused client) cannot make the orchestrator issue the prompt stream at once."""
        if self.trainer is None:
            return 0
        base = self.trainer.version if self.first_step is None else self.first_step
        version = min(self.trainer.version, base + self.consumed // self.prompts_per_step)
        budget = (version - base + self.max_staleness + 1) * self.prompts_per_step
        return max(0, budget - (self.consumed + len(self.buffered) + len(self.in_flight)))

    def issue(self, prompt: PromptRecord) -> str:
        """Record `prompt` as in flight; returns its request id."""
        rid = request_id(prompt.index)
        self.in_flight[rid] = prompt
        self.next_prompt = max(self.next_prompt, prompt.index + 1)
        return rid

    def trained_already(self, index: int) -> bool:
        """Whether the prompt drawn as `index` was trained in steps this state never recorded (catch_up): it is
        skipped, and forgotten here (the source draws each index once)."""
        if index not in self.trained_ahead:
            return False
        self.trained_ahead.discard(index)
        return True

    def abandon(self, request_id: str) -> None:
        """Every attempt of the request failed: it is counted and never trained."""
        if self.in_flight.pop(request_id, None) is not None:
            self.counts["failed_requests"] += 1

    # ---- completing -----------------------------------------------------------------------------------------
    def complete(self, group: Group, *, rewards_failed: int, dynamic_sampling: bool) -> Outcome:
        """A request's scored group (its failed rewards already masked out, `rewards_failed` of them)."""
        if self.in_flight.pop(group.request_id, None) is None:
            self.counts["duplicates_ignored"] += 1
            self.release(group.samples)  # a second answer's routing is its own objects, never the first's
            return Outcome("duplicate", group)
        self.counts["completed"] += 1
        self.counts["rewards_failed"] += rewards_failed
        if len(group.samples) < 2:  # no group left to compare against: no advantage to learn from
            self.counts["dropped_failed_groups"] += 1
            self.release(group.samples)
            return Outcome("too_few", group)
        rewards = [s.reward for s in group.samples]
        if dynamic_sampling and max(rewards) == min(rewards):
            self.counts["filtered_groups"] += 1
            self.release(group.samples)
            return Outcome("filtered", group)
        self.buffered.append(group)
        return Outcome("kept", group)

    # ---- batching -------------------------------------------------------------------------------------------
    def set_trainer(self, ref: VersionRef) -> bool:
        """The trainer posted `ref` (it trains step ref.version next). Returns whether it is new: a newer lineage
        or a higher version of the same one. A new lineage forks from the trainer's last version: its versions
        up to ref.version of the older lineage are the same weights (the checkpoint it resumed from)."""
        last = self.trainer or self.previous
        if self.trainer is not None and ref <= self.trainer:
            return False
        if last is not None and ref.lineage != last.lineage:
            self.forks[ref.lineage] = VersionRef(last.lineage, min(ref.version, last.version))
        self.trainer = ref
        return True

    def trainable(self, spans: list[VersionSpan], step: int, lineage: int) -> bool:
        """Whether step `step` of `lineage` may train a sample whose tokens these spans' weights sampled."""
        return tokens_trainable(VersionRef(lineage, step), spans, self.max_staleness, self.forks)

    def usable(self, weights: VersionRef) -> bool:
        """Whether a server holding `weights` may get a request now: its tokens could train the trainer's next
        step (the weights are within max_staleness of it, in its lineage's history, not newer)."""
        return self.trainer is not None and self.trainable([VersionSpan(weights.lineage, weights.version, 1)],
                                                           self.trainer.version, self.trainer.lineage)

    def _group_trainable(self, group: Group, step: int, lineage: int) -> bool:
        return all(self.trainable(s.versions, step, lineage) for s in group.samples)

    def drop_stale(self, step: int, lineage: int) -> list[Group]:
        """Remove and return the groups that step `step` of `lineage` may not train."""
        stale = [g for g in self.buffered if not self._group_trainable(g, step, lineage)]
        if stale:
            self.buffered = [g for g in self.buffered if self._group_trainable(g, step, lineage)]
            self.counts["dropped_stale_groups"] += len(stale)
            self._release_groups(stale)
        return stale

    def revalidate(self, step: int, lineage: int) -> list[str]:
        """Before a trainer of `lineage` gets the existing batch of `step`: if it holds a sample outside that
        lineage's history (a dead trainer's batch formed from its own later versions), it and every later batch
        are dropped (their groups counted stale) and re-formed. Returns the dropped request ids."""
        kept = self.batches.get(step)
        if kept is None or all(self.trainable(x.versions, step, lineage) for x in kept.samples):
            return []
        dropped = []
        for s in sorted(k for k in self.batches if k >= step):
            batch = self.batches.pop(s)
            self.release(batch.samples)
            ids = sorted(request_ids(batch))
            self.consumed -= len(ids)
            self.counts["dropped_stale_groups"] += len(ids)
            dropped += ids
        return dropped

    def check_step(self, step: int, committed: int) -> None:
        """Raises StepConflict, changing nothing, unless `step` is batched or the next to form and `committed`
        (the trainer's newest checkpoint) is not past it. A buffer that has formed no batch serves whichever step
        its trainer starts at (the orchestrator first makes sure that is the step its state is at: driver._begin)."""
        if committed > step:
            raise StepConflict(f"step {step}: its batch was forgotten or would be (committed={committed}: a "
                               f"checkpoint past it); a trainer asks for a step at or after its committed one")
        if step in self.batches or self.first_step is None:
            return
        expected = self.next_step()
        if step > expected:
            raise StepConflict(f"step {step}: the next batch to form is step {expected}; ask for that one (a trainer "
                               f"past it, which trained batches this state never recorded, posts its record of "
                               f"them to /v1/trained)")
        if step < expected:
            raise StepConflict(f"step {step}: its batch was forgotten (a trainer said a checkpoint past it was "
                               f"committed); the next batch to form is step {expected}")

    def next_step(self) -> int:
        """The step of the next batch to form (after a first one: each batch takes prompts_per_step groups)."""
        return self.first_step + self.consumed // self.prompts_per_step

    def catch_up(self, trained: dict[int, list[str]]) -> CaughtUp:
        """A trainer's record of the request ids it trained at each step (`trained`, contiguous steps), handed over
        when this state is behind it: restored from a checkpoint's older state after this orchestrator's own file
        was lost, while the trainer trained on. The steps from the next one to form through the record's last
        become formed (their groups consumed); their prompts are taken out of what waits (in flight, buffered) or
        skipped when drawn (`trained_ahead`): the prompt stream is a pure function of the seed and the draws, so
        none trains twice, and those the lost state had drawn but not trained are drawn again. Raises
        StepConflict or MalformedRecord, changing nothing, where the record does not fit this state."""
        steps = sorted(trained)
        if self.first_step is None:
            raise StepConflict("this orchestrator has formed no batch, so it has nothing to catch up")
        expected = self.next_step()
        if not steps or steps[-1] - steps[0] + 1 != len(steps):
            raise MalformedRecord(f"steps {steps[:8]}: a record of consecutive steps, at least one")
        if steps[-1] < expected:
            return CaughtUp(expected)  # nothing this state lacks (a repeated post: idempotent)
        if steps[0] > expected:
            raise RecordGap(f"the trainer's record begins at step {steps[0]} and this state ends before step "
                            f"{expected}: steps {expected}..{steps[0] - 1} are known to neither")
        held = set().union(*(request_ids(b) for b in self.batches.values()))
        ahead: list[str] = []
        for step in steps:
            ids = trained[step]
            bad = next((r for r in ids if prompt_index(r) is None), None)
            if bad is not None:
                raise MalformedRecord(f"trained[{step}]: {bad[:40]!r} is no request id of this orchestrator's "
                                      f"(p<prompt index>)")
            if step in self.batches and request_ids(self.batches[step]) != set(ids):
                raise StepConflict(f"step {step}: the trainer's record of its batch is not the batch this state "
                                   f"holds; they come from different runs")
            if step >= expected:
                if len(set(ids)) != len(ids) or len(ids) != self.prompts_per_step:
                    raise StepConflict(f"trained[{step}]: {len(ids)} request ids ({len(set(ids))} distinct); a "
                                       f"batch has prompts_per_step = {self.prompts_per_step} distinct ones")
                ahead += ids
        again = sorted(set(ahead) & held) or sorted(r for r, n in Counter(ahead).items() if n > 1)
        if again:
            raise StepConflict(f"request {again[0]}: the record trains it at two steps (or at a step this state "
                               f"holds another batch for); a prompt trains once")
        taken = set(ahead)
        cancelled = [r for r in self.in_flight if r in taken]
        for r in cancelled:
            del self.in_flight[r]
        dropped = [g for g in self.buffered if g.request_id in taken]
        self.buffered = [g for g in self.buffered if g.request_id not in taken]
        self.trained_ahead |= {i for i in map(prompt_index, ahead) if i >= self.next_prompt}
        self.consumed += (steps[-1] + 1 - expected) * self.prompts_per_step
        self.counts["caught_up_steps"] += steps[-1] + 1 - expected
        return CaughtUp(steps[-1] + 1, cancelled, dropped)

    def batch(self, step: int, lineage: int, committed: int,
              advantages: Callable[[list[float]], list[float]]) -> Batch | None:
        """The batch of step `step` (formed now if enough groups wait, else None); batches before `committed`
        (a checkpoint holds them: trained and checkpointed) are forgotten and their routing released.
        `advantages` is the algorithm's sequence advantages of one
        group's rewards. Raises StepConflict (check_step) before changing anything."""
        self.check_step(step, committed)
        for old in [s for s in self.batches if s < committed]:
            self.release(self.batches.pop(old).samples)
        if step in self.batches:
            if self.batches[step].lineage != lineage:  # a restarted trainer's: revalidate() checked its samples
                self.batches[step] = dataclasses.replace(self.batches[step], lineage=lineage)
            return self.batches[step]
        if len(self.buffered) < self.prompts_per_step:
            return None
        if self.first_step is None:  # fixed by the first batch formed, not by a request that formed none
            self.first_step = step
        taken, self.buffered = self.buffered[:self.prompts_per_step], self.buffered[self.prompts_per_step:]
        taken.sort(key=lambda g: g.prompt_index)
        self.consumed += len(taken)
        samples = []
        for g in taken:
            adv = advantages([s.reward for s in g.samples])
            for j, (s, a) in enumerate(zip(g.samples, adv)):
                samples.append(TrainingSample(id=sample_id(g.request_id, j), prompt_ids=g.prompt_ids,
                                              completion_ids=s.completion_ids, logprobs=s.logprobs, reward=s.reward,
                                              advantage=a, finished=s.finished, versions=s.versions,
                                              routing=s.routing))
        rewards = [s.reward for s in samples]
        stats = BatchStats(reward_mean=sum(rewards) / len(rewards),
                           accuracy=sum(r >= self.correct_reward for r in rewards) / len(rewards),
                           staleness_mean=sum(sample_staleness(step, s.versions) for s in samples) / len(samples),
                           dropped_stale_groups=self.counts["dropped_stale_groups"],
                           filtered_groups=self.counts["filtered_groups"], retries=self.counts["retries"],
                           rewards_failed=self.counts["rewards_failed"], completed=self.counts["completed"])
        batch = Batch(step=step, lineage=lineage, samples=samples, stats=stats, format=WIRE_FORMAT)
        self.batches[step] = batch
        return batch

    def demand(self) -> int:
        """Requests in flight plus those the budget allows now: the rollout autoscaler's signal."""
        return len(self.in_flight) + self.budget_left()

    # ---- state ----------------------------------------------------------------------------------------------
    def snapshot(self) -> OrchestratorState:
        return OrchestratorState(next_prompt=self.next_prompt, consumed=self.consumed,
                                 pending=sorted(self.in_flight.values(), key=lambda p: p.index),
                                 buffered=list(self.buffered), batches=dict(self.batches), counts=dict(self.counts),
                                 trainer=self.trainer, forks=dict(self.forks), first_step=self.first_step,
                                 trained_ahead=sorted(self.trained_ahead), format=STATE_FORMAT)

    @classmethod
    def restore(cls, state: OrchestratorState, *, prompts_per_step: int, max_staleness: int,
                correct_reward: float) -> "GroupBuffer":
        """A buffer from a checkpoint. The prompts that were in flight are in flight again (the orchestrator
        issues them anew: same prompt, same seed). The trainer's version is only where a new lineage forks:
        until the restarted trainer posts its own, nothing is issued."""
        buf = cls(prompts_per_step, max_staleness, correct_reward, next_prompt=state.next_prompt,
                  consumed=state.consumed, first_step=state.first_step, previous=state.trainer, forks=dict(state.forks),
                  in_flight={request_id(p.index): p for p in state.pending}, buffered=list(state.buffered),
                  batches=dict(state.batches), trained_ahead=set(state.trained_ahead))
        buf.counts.update(state.counts)
        return buf


def request_ids(batch: Batch) -> set[str]:
    """The requests (prompts) whose samples a batch holds."""
    return {request_of(s.id) for s in batch.samples}
