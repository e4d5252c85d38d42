"""The orchestrator: one asyncio event loop that issues prompts within the staleness budget, sends each as a
completion request to the pool's choice of server (retried elsewhere when it fails, hedged on a second server
when it straggles), scores the completions, and hands the buffer's batches to the trainer, which posts each
version it publishes (pushed to every server).

The buffer and the counters are touched only on the event loop; the pool has its own lock (pool.py); rewards
are scored in worker threads (user code may block).

Restarts: the state is written to its own file every step, before the step's batch is served (state_file.py). A
restarted orchestrator continues from that file; with `--resume` it also holds the trainer checkpoint's state and
takes that one instead if the trainer's first post names a new lineage (the trainer restarted too, from its
checkpoint: the batches after it are formed again from the same prompts and seeds). Until the trainer posts, no
prompt is issued and a batch request is answered at once with the version held (none), so the trainer re-posts
its version within one poll (trainer/orchestrator_link.py HttpBatchSource).

A restart that lost the state file (a fresh volume) and resumed from the checkpoint's older state while the trainer
trained on is behind the trainer: its next batch to form is older than the step asked for (409). The trainer then
hands over its record of the batches it trained (`catch_up`: the request ids of each step since its second newest
checkpoint), and the orchestrator takes those steps as formed and their prompts out of the stream (buffer.py
GroupBuffer.catch_up), so no prompt trains twice; a state older than that record (an explicit older `--resume`
path) is first replaced by the run's newest checkpoint's (`_adopt_checkpoint`); one started with no state at all
serves no step past 0 from the stream's start (`_begin`): it is caught up as the state at step 0. Until the trainer
commits a checkpoint at or past the step caught up to, the state as it was before is held (in the state file too:
an orchestrator restarted meanwhile keeps it): a trainer that dies and resumes from the older checkpoint (a new
lineage asking for a step only that state can serve) gets that one, and the batches after the checkpoint are
formed again.

Routing replay: the servers write each choice's routed experts to the routing store and answer references; the
orchestrator keeps and serves only those, and deletes the objects no sample will train any more (from a worker
thread, after the buffer releases them; orphans by age: routing_store.py says when).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.deadlines import Deadline, request_deadline
from moe_rl_eks.core.run import RunConfig

from ..rl.checkpoint_dirs import ORCHESTRATOR_STATE, final_dir
from ..rl.data import PromptSource
from ..rl.openai_api import CompletionRequest
from ..rl.protocol import (Batch, Choice, Completion, Group, HeldState, OrchestratorState, PromptRecord, Sample,
                        VersionRef, derive_seed)
from ..rl.routing_store import RoutingStore
from ..rl.runtime import Registry, output_dir
from .buffer import GroupBuffer, MalformedRecord, RecordGap, StepConflict, request_ids
from .client import DeadlineMissed, RequestFault, RolloutBackend, RolloutFault, ServerFault
from .pool import ServerPool
from .state_file import checkpoint_state_path, read_state, write_state

log = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 2.0
IDLE_TICK_S = 0.5  # the dispatcher also looks again this often (servers may have become ready)
HEDGE_RETRY_S = 0.1  # a straggler with no other server free looks again this often
REFUSALS_BEFORE_PAUSE = 8  # requests refused (4xx) everywhere in a row: then new prompts wait, doubling up to
MAX_PAUSE_S = 30.0  # this, instead of burning through the prompt stream while a setting is wrong


# (prompt, completion text, finished) -> one score each, None where the reward failed (masked, never faked)
ScoreMany = Callable[[list[tuple[PromptRecord, str, bool]]], list[float | None]]


@dataclass
class Settings:
    """What the orchestrator reads of the run, in one place."""

    prompts_per_step: int
    max_staleness: int
    group_size: int
    dynamic_sampling: bool
    routing_replay: bool
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    seed: int
    correct_reward: float
    request_timeout_s: float
    straggler_after_s: float
    straggler_factor: float
    min_row_tokens_per_s: float
    max_attempts: int
    weight_push_timeout_s: float
    model: str
    routing_dir: str  # the routing store (rl.routing), used when routing_replay is on
    routing_orphan_after_s: float

    @classmethod
    def of(cls, run: RunConfig) -> "Settings":
        rl = run.rl
        return cls(rl.training.prompts_per_step, rl.orchestrator.max_staleness, rl.algorithm.group_size,
                   rl.algorithm.dynamic_sampling, rl.algorithm.routing_replay, rl.sampling.max_tokens,
                   rl.sampling.ignore_eos,
                   rl.sampling.temperature, rl.sampling.top_p, rl.training.seed, rl.reward.pass_threshold,
                   rl.orchestrator.request_timeout_s, rl.orchestrator.straggler_after_s,
                   rl.orchestrator.straggler_factor, run.rollout.min_row_tokens_per_s, rl.orchestrator.max_attempts,
                   rl.orchestrator.weight_push_timeout_s, run.name,
                   rl.routing.directory(str(output_dir(run))), rl.routing.orphan_after_s)

    def deadline(self, row_tokens_per_s: float | None) -> Deadline:
        """A request's deadline on a server decoding each row at `row_tokens_per_s` (core/deadlines.py)."""
        return request_deadline(self.max_tokens, row_tokens_per_s=row_tokens_per_s,
                                floor_tokens_per_s=self.min_row_tokens_per_s, straggler_factor=self.straggler_factor,
                                allowance_s=self.straggler_after_s, cap_s=self.request_timeout_s)


class Orchestrator:
    def __init__(self, settings: Settings, pool: ServerPool, backend: RolloutBackend, source: PromptSource,
                 score_many: ScoreMany, advantages: Callable[[list[float]], list[float]], *,
                 events_path: Path | None = None, state: OrchestratorState | None = None,
                 fallback: OrchestratorState | None = None, state_path: Path | None = None,
                 checkpoints: Path | None = None, evaluator: Any = None) -> None:
        """`state`: where to continue from (this orchestrator's own last state, or a checkpoint's); `fallback`:
        the trainer checkpoint's state, taken instead if the trainer's first post names a new lineage;
        `state_path`: where the state is written every step; `checkpoints`: the run's trainer checkpoints, whose
        newest state is caught up instead of one older than the trainer's record (_adopt_checkpoint)."""
        self.s, self.pool, self.backend, self.source = settings, pool, backend, source
        self.evaluator = evaluator  # evaluation.PeriodicEvaluator: evaluates a version on the first server holding it
        self.score_many, self.advantages = score_many, advantages
        self.metrics = Registry()
        self.routing = RoutingStore(settings.routing_dir, registry=self.metrics) if settings.routing_replay else None
        self._swept = 0.0  # monotonic time of the last orphan sweep
        self.buffer = GroupBuffer(settings.prompts_per_step, settings.max_staleness, settings.correct_reward)
        self._caught_up: HeldState | None = None  # the state before a catch-up, until a checkpoint retires it
        if state is not None:
            self._restore(state)
            self._caught_up = state.held  # persisted with the state file's state (a checkpoint's holds none)
        self._stateless = state is None  # started with no state at all, until its first batch request (_begin)
        self._fallback = fallback
        self.state_path, self.checkpoints = state_path, checkpoints
        self._persisting: asyncio.Lock | None = None
        self.events = open(events_path, "a") if events_path else None
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> the task driving it
        self._background: set[asyncio.Task] = set()
        self._refused_in_a_row = 0
        self._paused_until = 0.0
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self.running = False

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _restore(self, state: OrchestratorState, *, restart: bool = True) -> None:
        """Continue from `state`; `restart`: this is a new start (counted), not a state replaced in this life."""
        held = self.buffer.live_routing()  # a live buffer replaced by a checkpoint's: its newer routing is orphaned
        self.buffer = GroupBuffer.restore(state, prompts_per_step=self.s.prompts_per_step,
                                          max_staleness=self.s.max_staleness, correct_reward=self.s.correct_reward)
        self.source.restore(state.source)
        kept = self.buffer.live_routing()
        self.buffer.released += [ref for key, ref in held.items() if key not in kept]
        self.buffer.counts["restarts"] += restart
        self.metrics[M.ORCHESTRATOR_RESTARTS].set(self.buffer.counts["restarts"])

    async def start(self) -> None:
        self._wake, self._changed = asyncio.Event(), asyncio.Condition()
        self._persisting = asyncio.Lock()
        self.running = True
        self._spawn(self._dispatch_loop())
        self._spawn(self._health_loop())

    async def stop(self) -> None:
        self.running = False
        tasks = [*self._tasks.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.backend.close()
        if self.evaluator is not None:
            await asyncio.to_thread(self.evaluator.close)  # lets a running evaluation finish and record
        if self.events:
            self.events.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _event(self, kind: str, **fields) -> None:
        if self.events:
            self.events.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")
            self.events.flush()

    async def _notify(self) -> None:
        self._wake.set()
        async with self._changed:
            self._changed.notify_all()

    # ---- the trainer's side ---------------------------------------------------------------------------------
    async def publish(self, ref: VersionRef) -> VersionRef | None:
        """The trainer published `ref`: requests go to servers whose weights are within max_staleness of it from
        now on (GroupBuffer.usable), and every healthy server is told to load it (in the background: a slow server
        never stalls the trainer)."""
        if self._fallback is not None and self.buffer.trainer is None:  # the first post since this start
            previous = self.buffer.previous
            if previous is None or ref.lineage != previous.lineage:  # the trainer restarted from its checkpoint
                log.info("trainer resumed in lineage %d: continuing from its checkpoint's orchestrator state",
                         ref.lineage)
                self._restore(self._fallback)
                self._caught_up = None  # the checkpoint the trainer resumed from is the state to serve it
            self._fallback = None
        if self.buffer.set_trainer(ref):
            log.info("trainer published %s", ref)
            self._push_all(ref)
            await self._notify()
        return self.buffer.trainer

    async def batch(self, step: int, committed: int, timeout_s: float) -> Batch | None:
        """The batch of `step` for the trainer's lineage, or None if not ready within `timeout_s` (at once while
        no trainer version is known: nothing can form until the trainer posts one). Raises buffer.StepConflict for
        a step that is neither batched nor the next one. A batch formed now is persisted before it is returned."""
        if self.buffer.trainer is None:
            return None
        if self._stateless:
            await self._begin(step, committed)
        if self._caught_up is not None:
            self._after_catch_up(step, committed)
        batch, formed = await self._wait_batch(step, committed, timeout_s)
        if formed:
            await self.persist()
        # after the persist: a state on disk never refers to routing already deleted, except by a step's lag
        await self.collect_routing(sweep=formed)
        return batch

    async def _begin(self, step: int, committed: int) -> None:
        """The first batch request to an orchestrator started with no state at all (neither its own file nor
        `--resume`: a fresh volume, or a first start beside a trainer already under way). A trainer past step 0
        trained prompts this orchestrator would otherwise draw again from the start of the stream, so none is
        served from there: a trainer resumed from its checkpoint (`committed` > 0) at that checkpoint's next step
        is served from its orchestrator state, as `--resume` of it would be; any other is refused (409, changing
        nothing), and its record then catches this orchestrator up (catch_up: as the state at step 0, which a
        fresh stream is, or as the run's newest checkpoint's where the record begins later)."""
        if not step:  # a new run, or a trainer starting over
            self._stateless = False
            return
        if not committed:
            raise StepConflict(f"step {step}: this orchestrator started with no state, the state at step 0: the "
                               f"next batch to form is step 0 (a trainer past it posts its record of the batches "
                               f"it trained to /v1/trained)")
        path = None if self.checkpoints is None else final_dir(self.checkpoints, committed) / ORCHESTRATOR_STATE
        try:
            state = None if path is None else await asyncio.to_thread(read_state, path)
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or a state this code refuses
            raise StepConflict(f"step {step}: this orchestrator started with no state, and the orchestrator state of "
                               f"the trainer's checkpoint at step {committed} ({path}) is unreadable: {exc}") from None
        if state is None:
            raise StepConflict(f"step {step}: this orchestrator started with no state, and the trainer's checkpoint "
                               f"at step {committed} has no orchestrator state at {path}: restart it with --resume "
                               f"naming the orchestrator.json saved with that checkpoint")
        probe = GroupBuffer.restore(state, prompts_per_step=self.s.prompts_per_step,
                                    max_staleness=self.s.max_staleness, correct_reward=self.s.correct_reward)
        try:
            probe.check_step(step, committed)
        except StepConflict as exc:
            raise StepConflict(f"this orchestrator started with no state, and in the state of the trainer's "
                               f"checkpoint at step {committed} ({path}): {exc}") from None
        log.warning("started with no state: serving the trainer from its checkpoint's orchestrator state %s", path)
        trainer = self.buffer.trainer
        self._restore(state)  # counted as a start, as --resume of it would be
        self.buffer.set_trainer(trainer)
        self._stateless = False

    def _after_catch_up(self, step: int, committed: int) -> None:
        """After a catch-up: a trainer of a newer lineage asking for a step only the state before the catch-up can
        serve resumed from the older checkpoint (the steps caught up died with its predecessor): that state is
        restored for it. A checkpoint at or past the step caught up to retires it."""
        held, trainer = self._caught_up, self.buffer.trainer
        if committed >= held.until:
            self._caught_up = None
        elif (trainer.lineage > held.lineage and step not in self.buffer.batches and step < self.buffer.next_step()
                and (step in held.state.batches or step == held.next_step)):
            log.info("trainer resumed in lineage %d at step %d, before the catch-up: continuing from the state "
                     "before it", trainer.lineage, step)
            self._replace_state(held.state)

    def _replace_state(self, state: OrchestratorState) -> None:
        """Continue from `state` in this life, keeping the trainer's version (it posted it to this process) and
        the count of starts (this one is counted already; `state` may be from before it)."""
        trainer, restarts = self.buffer.trainer, self.buffer.counts["restarts"]
        self._caught_up = None
        self._restore(state, restart=False)
        self.buffer.counts["restarts"] = max(restarts, self.buffer.counts["restarts"])
        self.metrics[M.ORCHESTRATOR_RESTARTS].set(self.buffer.counts["restarts"])
        self.buffer.set_trainer(trainer)

    async def catch_up(self, trained: dict[int, list[str]]) -> int:
        """The trainer's record of the request ids it trained at each step, for a state behind it (module
        docstring); returns the next step to form. A record that begins after this state ends (restored from a
        state older than the trainer's second newest checkpoint) catches up the run's newest checkpoint's state
        instead (_adopt_checkpoint). Raises buffer.StepConflict or MalformedRecord, changing nothing, for a record
        that does not fit. The state caught up is persisted before this returns."""
        if self.buffer.trainer is None:
            raise StepConflict("no trainer version is held: a trainer posts its version before its record")
        adopted = False
        bare = self._stateless and self.buffer.first_step is None  # started with no state, nothing formed (_begin)
        if bare:
            self.buffer.first_step = 0  # a stream drawn from its start is the state at step 0
        try:
            try:
                before = self.snapshot()
                done = self.buffer.catch_up(trained)
            except RecordGap as gap:
                await self._adopt_checkpoint(trained, gap)
                adopted = True
                before = self.snapshot()
                done = self.buffer.catch_up(trained)
        except (StepConflict, MalformedRecord):
            if bare and not adopted:  # refused: as it was
                self.buffer.first_step = None
            raise
        if bare:
            log.warning("started with no state: caught up to the trainer's record %s",
                        "from the run's newest checkpoint state" if adopted else "as the state at step 0")
            self._stateless = False
            self.buffer.counts["restarts"] += 1  # this start, found to be a restart of the run's orchestrator
            self.metrics[M.ORCHESTRATOR_RESTARTS].set(self.buffer.counts["restarts"])
        steps = self.buffer.counts["caught_up_steps"] - before.counts["caught_up_steps"]
        if steps or adopted:
            self.metrics[M.ORCHESTRATOR_CATCH_UPS].labels(state="newest_checkpoint" if adopted else "own").inc()
            self.metrics[M.ORCHESTRATOR_CAUGHT_UP_STEPS].inc(steps)
        if not steps:  # nothing this state lacked (the checkpoint adopted may have reached the trainer's step)
            if adopted:
                await self.persist()
                await self._notify()
            return done.next_step
        for request_id in done.cancelled:  # those prompts trained already: their answers would be ignored
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()
        # caught up twice before a checkpoint: the oldest state is the one to keep. The groups taken out keep their
        # routing: that state refers to them and may yet train them (a trainer resumed from the checkpoint); once it
        # is retired, the orphan sweep deletes what nothing refers to.
        held = self._caught_up or HeldState(before, done.next_step - steps, self.buffer.trainer.lineage, 0)
        self._caught_up = dataclasses.replace(held, until=done.next_step)
        log.warning("caught up to the trainer: steps %d..%d were trained from batches this state never recorded "
                    "(it is older than the trainer); %d requests in flight and %d groups taken out, %d prompts to "
                    "skip when drawn", done.next_step - steps, done.next_step - 1, len(done.cancelled),
                    len(done.dropped), len(self.buffer.trained_ahead))
        self._event("caught_up", next_step=done.next_step, cancelled=done.cancelled,
                    dropped=[g.request_id for g in done.dropped])
        await self.persist()
        await self._notify()
        return done.next_step

    async def _adopt_checkpoint(self, trained: dict[int, list[str]], gap: RecordGap) -> None:
        """The trainer's record begins after this state ends (an orchestrator restarted from a state older than
        the record: an explicit older `--resume` path): the steps between are known to neither, but the run's
        newest trainer checkpoint holds the orchestrator state at its step. That state is taken instead where the
        record catches it up (tried on a copy first), so the trainer goes on at its step; else the gap is raised,
        naming that state too, and nothing changes."""
        path = None if self.checkpoints is None else checkpoint_state_path(self.checkpoints)
        try:
            newer = None if path is None else await asyncio.to_thread(read_state, path)
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or a state this code refuses (ProtocolError)
            raise RecordGap(f"{gap}; the run's newest checkpoint state {path} is unreadable: {exc}") from None
        if newer is None:
            raise RecordGap(f"{gap}, and the run has no checkpoint state to take instead: restart the orchestrator "
                            f"from the trainer's newest checkpoint (--resume latest)")
        probe = GroupBuffer.restore(newer, prompts_per_step=self.s.prompts_per_step,
                                    max_staleness=self.s.max_staleness, correct_reward=self.s.correct_reward)
        try:
            probe.catch_up(trained)
        except (StepConflict, MalformedRecord) as exc:
            raise type(exc)(f"{gap}; nor does the trainer's record fit the run's newest checkpoint state {path}: "
                            f"{exc}") from None
        old = self.buffer.next_step() if self.buffer.first_step is not None else None
        log.warning("adopted the run's newest checkpoint state %s (next step %d) in place of this state (next step "
                    "%s), which is older than the trainer's record of steps %d..%d; catching that one up", path,
                    newer.first_step + newer.consumed // self.s.prompts_per_step, old, min(trained), max(trained))
        self._event("adopted_checkpoint", path=str(path), consumed=newer.consumed, replaced_next_step=old)
        self._replace_state(newer)

    async def persist(self) -> None:
        """Write the state as it is now to `state_path` (snapshot taken on the loop, written in a thread; one
        write at a time, in order)."""
        if self.state_path is None:
            return
        async with self._persisting:
            state = dataclasses.replace(self.snapshot(), held=self._caught_up)
            await asyncio.to_thread(write_state, self.state_path, state)

    async def _wait_batch(self, step: int, committed: int, timeout_s: float) -> tuple[Batch | None, bool]:
        """(the batch or None, whether it was formed by this call)."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                trainer = self.buffer.trainer
                if trainer is not None:
                    self.buffer.check_step(step, committed)  # a refused request changes nothing
                    for request_id in self.buffer.revalidate(step, trainer.lineage):
                        self._event("dropped_stale", request_id=request_id, step=step, lineage=trainer.lineage)
                    known = step in self.buffer.batches
                    if not known:
                        for g in self.buffer.drop_stale(step, trainer.lineage):
                            self.metrics[M.SAMPLES_DROPPED_STALE].inc(len(g.samples))
                            self._event("dropped_stale", request_id=g.request_id, version=g.version.to_json(),
                                        step=step)
                    batch = self.buffer.batch(step, trainer.lineage, committed, self.advantages)
                    if batch is not None:
                        if not known:
                            self._formed(batch)
                        return batch, not known
                left = deadline - time.monotonic()
                if left <= 0 or not self.running:
                    return None, False
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def collect_routing(self, *, sweep: bool = False) -> None:
        """Delete the routing the buffer released (in a thread: unlinks on a shared filesystem); with `sweep`,
        also the orphans (at most every quarter of rl.routing.orphan_after_s: a sweep lists the whole store)."""
        released = self.buffer.take_released()
        if self.routing is None:
            return
        if released:
            await asyncio.to_thread(self.routing.delete, released)
        now = time.monotonic()
        if sweep and now - self._swept >= self.s.routing_orphan_after_s / 4:
            self._swept = now
            live = set(self.buffer.live_routing())
            for held in (self._fallback, self._caught_up and self._caught_up.state):
                if held:  # a state this orchestrator may still continue from
                    live |= routing_keys(held)
            await asyncio.to_thread(self.routing.sweep, live, self.s.routing_orphan_after_s)
        self.metrics[M.ROUTING_BYTES_STORED].set(sum(r.bytes for r in self.buffer.live_routing().values()))

    def _formed(self, batch: Batch) -> None:
        self.metrics[M.REWARD_MEAN].set(batch.stats.reward_mean)
        self.metrics[M.SAMPLE_STALENESS].set(batch.stats.staleness_mean)
        token_staleness = self.metrics[M.SAMPLE_TOKEN_STALENESS]
        for sample in batch.samples:
            for span in sample.versions:
                token_staleness.observe(batch.step - span.version, span.tokens)
        self._event("batched", step=batch.step, request_ids=sorted(request_ids(batch)))
        self._wake.set()  # the budget moved

    def snapshot(self) -> OrchestratorState:
        return dataclasses.replace(self.buffer.snapshot(), source=self.source.state())

    # ---- issuing --------------------------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while self.running:
            self._fill()
            self.metrics[M.ROLLOUT_QUEUE_DEPTH].set(self.buffer.demand())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=IDLE_TICK_S)
            except asyncio.TimeoutError:
                pass

    def _fill(self) -> None:
        """Draw every prompt the budget allows (they count as in flight from now on), then send those that wait
        for a server while the pool has room."""
        if self.buffer.trainer is None:
            return
        for _ in range(self.buffer.budget_left() if time.monotonic() >= self._paused_until else 0):
            prompt = self.source.next()
            while self.buffer.trained_already(prompt.index):
                prompt = self.source.next()
            self.buffer.issue(prompt_record(prompt))
        waiting = sorted((p.index, rid) for rid, p in self.buffer.in_flight.items() if rid not in self._tasks)
        for i, (_, request_id) in enumerate(waiting):
            url = self.pool.acquire(self.buffer.usable, demand=len(waiting) - i)
            if url is None:
                return
            prompt = self.buffer.in_flight[request_id]
            self._tasks[request_id] = asyncio.get_running_loop().create_task(self._request(request_id, prompt, url))

    def _request_body(self, prompt: PromptRecord, draw: int = 0) -> CompletionRequest:
        """The request for `prompt`'s group; `draw` > 0 after that many deadline misses: a new derived seed, so
        the retry samples other completions instead of the same too-long ones (a retry after a server fault keeps
        the seed: the same request retried anywhere samples the same completions)."""
        s = self.s
        seed = derive_seed(s.seed, prompt.index, draw) if draw else derive_seed(s.seed, prompt.index)
        return CompletionRequest(prompt=list(prompt.prompt_ids), n=s.group_size,
                                 max_tokens=prompt.max_tokens or s.max_tokens, ignore_eos=s.ignore_eos or None,
                                 temperature=s.temperature, top_p=s.top_p, seed=seed,
                                 model=s.model, return_routing=s.routing_replay, logprobs=0,
                                 logprob_mode="processed")  # what the trainer scores: after temperature / top-p

    async def _request(self, request_id: str, prompt: PromptRecord, url: str) -> None:
        """Drive one request to a scored group: up to max_attempts servers, each attempt hedged once."""
        draws = 0
        try:
            for attempt in range(1, self.s.max_attempts + 1):
                try:
                    completion = await self._attempt(request_id, self._request_body(prompt, draws), url)
                    break
                except RolloutFault as fault:
                    log.warning("request %s attempt %d failed: %s", request_id, attempt, fault)
                    if isinstance(fault, DeadlineMissed):
                        draws += 1
                        self._count("deadline_misses")
                    if attempt == self.s.max_attempts:
                        self.buffer.abandon(request_id)
                        self._event("failed", request_id=request_id, error=str(fault))
                        self._refused(fault)
                        return
                self._count("retries")
                url = await self._server_for_retry(exclude=url)
            self._refused_in_a_row = 0
            await self._completed(request_id, prompt, completion)
        except Exception:
            # A bug after the reply (scoring, a malformed record): the request is lost, loudly; counts stay right.
            log.exception("request %s failed after its reply", request_id)
            self.buffer.abandon(request_id)
            self._event("failed", request_id=request_id, error="internal")
        finally:
            self._tasks.pop(request_id, None)
            self._wake.set()

    def _refused(self, fault: RolloutFault) -> None:
        """A request failed on every attempt; if many in a row were refused (4xx), pause new prompts."""
        self._refused_in_a_row = self._refused_in_a_row + 1 if isinstance(fault, RequestFault) else 0
        over = self._refused_in_a_row - REFUSALS_BEFORE_PAUSE
        if over >= 0:
            pause = min(MAX_PAUSE_S, 0.5 * 2 ** over)
            self._paused_until = time.monotonic() + pause
            log.error("%d requests in a row refused by every server they were sent to (last: %s); new prompts wait "
                      "%.1f s", self._refused_in_a_row, fault, pause)

    async def _server_for_retry(self, exclude: str) -> str:
        """A server for the next attempt: another ready one if there is one, else whichever becomes ready."""
        while True:
            usable = self.buffer.usable
            url = self.pool.acquire(usable, exclude=(exclude,)) or self.pool.acquire(usable)
            if url is not None:
                return url
            await asyncio.sleep(HEALTH_INTERVAL_S / 2)

    async def _send(self, url: str, body: CompletionRequest, sent: asyncio.Event | None,
                    timeout_s: float) -> Completion:
        """One call; the server's in-flight count is released however it ends (answer, fault, cancel, bug). A
        deadline miss leaves the server healthy: it was busy with long rows, not broken."""
        try:
            completion = await self.backend.complete(url, body, timeout_s=timeout_s, sent=sent)
            if not completion.lineage_reported:
                ref = self.pool.attribute(url, completion.version)
                if ref is None:  # weights we cannot place in any lineage: never trained
                    raise ServerFault(url, f"answered with version {completion.version.version} of no known lineage")
                completion = dataclasses.replace(completion, version=ref, lineage_reported=True)
            return completion
        except ServerFault:
            self.pool.unhealthy(url)
            raise
        finally:
            self.pool.release(url)

    async def _attempt(self, request_id: str, body: CompletionRequest, url: str) -> Completion:
        """Send to `url` under the deadline its per-row rate gives (Settings.deadline); if no answer by its
        straggler time after it was SENT (not issued: time spent waiting for a connection does not count), also
        send to another ready server; the first answer wins and the other call is cancelled, which closes its
        connection. Raises the last fault when every call failed."""
        deadline = self.s.deadline(self.pool.row_rate(url))
        sent = asyncio.Event()
        calls = {asyncio.ensure_future(self._send(url, body, sent, deadline.timeout_s))}
        try:
            sent_wait = asyncio.ensure_future(sent.wait())
            await asyncio.wait({*calls, sent_wait}, timeout=deadline.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            sent_wait.cancel()
            done, _ = await asyncio.wait(calls, timeout=deadline.straggler_after_s if sent.is_set() else 0)
            while not done and sent.is_set():  # straggling: hedge as soon as another server has room
                hedge_url = self.pool.acquire(self.buffer.usable, exclude=(url,))
                if hedge_url is not None:
                    log.info("request %s straggles on %s; also sent to %s", request_id, url, hedge_url)
                    self._count("hedges")
                    self._count("retries")
                    hedge = self.s.deadline(self.pool.row_rate(hedge_url))
                    calls.add(asyncio.ensure_future(self._send(hedge_url, body, None, hedge.timeout_s)))
                    break
                done, _ = await asyncio.wait(calls, timeout=HEDGE_RETRY_S)
            fault: RolloutFault | None = None
            pending = calls
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for call in done:
                    if call.exception() is None:
                        return call.result()
                    exc = call.exception()
                    if not isinstance(exc, RolloutFault):
                        raise exc
                    fault = exc
            raise fault
        finally:
            for call in calls:
                call.cancel()

    def _count(self, name: str) -> None:
        self.buffer.counts[name] += 1
        if name == "retries":
            self.metrics[M.ROLLOUT_RETRIES].inc()
        elif name == "deadline_misses":
            self.metrics[M.ROLLOUT_DEADLINE_MISSES].inc()

    # ---- completing -----------------------------------------------------------------------------------------
    async def _completed(self, request_id: str, prompt: PromptRecord, completion: Completion) -> None:
        items = [(prompt, c.text, c.finish_reason == "stop") for c in completion.choices]
        scores = await asyncio.to_thread(self.score_many, items)
        samples = [sample_of(c, score) for c, score in zip(completion.choices, scores) if score is not None]
        failed = len(completion.choices) - len(samples)
        self.buffer.release([c for c, score in zip(completion.choices, scores) if score is None])  # masked
        group = Group(request_id, prompt.index, list(prompt.prompt_ids), completion.version, samples)
        outcome = self.buffer.complete(group, rewards_failed=failed, dynamic_sampling=self.s.dynamic_sampling)
        if outcome.kind != "duplicate":
            # in the event loop's step that changed the buffer: a state snapshot (GET /v1/state, a checkpoint)
            # holds the group's outcome and its events both or neither (its counts say how many completed)
            self._event("completed", request_id=request_id, version=completion.version.to_json())
            if outcome.kind == "filtered":
                self._event("filtered", request_id=request_id)
            elif outcome.kind == "too_few":
                self._event("dropped_failed", request_id=request_id, rewards_failed=failed)
        await self.collect_routing()
        if outcome.kind == "duplicate":
            return
        self.metrics[M.REWARD_FAILURES].inc(failed)
        if outcome.kind == "filtered":
            self.metrics[M.SAMPLES_FILTERED].inc(len(samples))
        await self._notify()

    # ---- servers --------------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while self.running:
            await asyncio.to_thread(self.pool.discover)
            await asyncio.gather(*(self._check(url) for url in self.pool.urls()))
            if self.buffer.trainer is not None:
                self._push_all(self.buffer.trainer)
            self._wake.set()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, url: str) -> None:
        try:
            health = await self.backend.health(url, timeout_s=HEALTH_TIMEOUT_S)
        except RolloutFault:
            self.pool.unhealthy(url)
            return
        self.pool.healthy(url, health.weight_version, health.weight_lineage, health.row_tokens_per_s)

    def _push_all(self, ref: VersionRef) -> None:
        for url in self.pool.needing(ref):
            self._spawn(self._push(url, ref))

    async def _push(self, url: str, ref: VersionRef) -> None:
        try:
            await self.backend.load_weights(url, ref, timeout_s=self.s.weight_push_timeout_s)
        except RolloutFault as fault:
            log.warning("server %s did not load %s: %s", url, ref, fault)
            self.pool.pushed(url, ref, loaded=False)
            if isinstance(fault, (ServerFault, DeadlineMissed)):  # a load past its deadline: stuck, not busy
                self.pool.unhealthy(url)
            return
        self.pool.pushed(url, ref, loaded=True)
        if self.evaluator is not None:
            self.evaluator.maybe_start(ref.version, url)
        self._wake.set()


def routing_keys(state: OrchestratorState) -> set[str]:
    """The routing objects a state's samples refer to (waiting groups and kept batches)."""
    samples = [s for g in state.buffered for s in g.samples] + [s for b in state.batches.values() for s in b.samples]
    return {s.routing.key for s in samples if s.routing is not None}


def prompt_record(prompt: Any) -> PromptRecord:
    return PromptRecord(prompt.index, list(prompt.prompt_ids), prompt.text, prompt.ground_truth,
                        prompt.data_source, dict(prompt.extra_info), prompt.max_tokens)


def sample_of(choice: Choice, reward: float) -> Sample:
    return Sample(choice.token_ids, choice.logprobs, reward, choice.finish_reason == "stop", choice.versions,
                  choice.routing)

