"""The rollout engine: rows in, tokens streamed out, continuous batching over one model replica.

`RolloutEngine.submit(rows, on_tokens)` queues rows and returns a Future of their `RowOutput`s; one engine thread
owns the replica (which owns each rank's `Decoder`) and loops: take what was submitted or cancelled, send new rows
and cancels to the replica's ranks, run one step there (each rank admits rows into free row slots and KV-cache
blocks, then runs a prefill chunk and/or one decode forward for every running row), hand each call its tokens of the
step (one `on_tokens` call, only to calls that asked) and report each finished row. Rows join and
leave the batch at every step. The engine counts its tokens and their latencies itself (generation tokens, time to
first token, inter-token latency), once per step, so a caller that only wants the result costs nothing per token.

Locking rule: callers only append to the inbox under `_lock` (and wake the loop); everything else (the replica,
the rows' state) belongs to the engine thread alone.

Weight swaps: `load_version` reads a version in the background while serving goes on, then asks the loop to swap
it in (`RunConfig.weight_swap`). In flight (`inflight`), the loop swaps at its next step whatever runs: rows keep
their slots and KV cache and sample their next tokens with the new weights, and each row's `weight_versions` spans
say which tokens came from which version. Drained (`drain`), the swap waits until no row runs and holds the rows
submitted after it, so every token of a row comes from one version (one span). The engine sends each new row to the
replica's rank with the fewest (one rank in one process; one per GPU with `rollout.gpus_per_server` > 1, each with
its own decoder and rows), and every step runs on all ranks together (`Replica.step`): one step path in both.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path


from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.run import RunConfig

from ..model import MoETransformer
from ..rl.protocol import VersionRef
from ..rl.runtime import Registry
from ..rl.tokenizer import Tokenizer
from ..rl.weights import WeightStore
from .engine_api import EngineHealth, RowOutput, RowRequest, SamplingParams, TokenEvent
from .replica import RankReport, Replica, StepPlan, rows_per_rank

__all__ = ["EngineHealth", "RolloutEngine", "RowOutput", "RowRequest", "SamplingParams", "TokenEvent", "VersionRef"]
log = logging.getLogger(__name__)
STEP_AVERAGE_WEIGHT = 0.1  # of the newest step in the per-row decode rate (about the last 10 steps count)


@dataclass(eq=False)
class _Call:
    """One submit(): its rows, where their outputs go, and the Future that resolves when all have finished."""

    rows: list[RowRequest]
    on_tokens: Callable[[list[TokenEvent]], None] | None
    future: Future = field(default_factory=Future)
    outputs: list[RowOutput | None] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)  # rows cancelled before they were admitted
    left: int = 0
    submitted: float = field(default_factory=time.monotonic)
    sampled: list[int] = field(default_factory=list)  # tokens sampled so far, per row


@dataclass(eq=False)
class _Control:
    """A replica operation for the loop to run; a drained `swap` waits until no row is running."""

    op: str
    args: tuple
    done: Future = field(default_factory=Future)


class RolloutEngine:
    def __init__(self, run: RunConfig, store: WeightStore, cache_dir: Path, tokenizer: Tokenizer,
                 replica: Replica | None = None) -> None:
        self.run, self.store, self.cache_dir, self.tokenizer = run, store, cache_dir, tokenizer
        self.replica = replica or Replica(run)
        self.metrics = Registry()
        self.busy_seconds = 0.0
        self._step_device_seconds = 0.0  # the last step's, until _count_busy counts it
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Call | _Control] = []
        self._cancels: list[tuple[str, frozenset[int] | None]] = []
        self._stopping = False
        self._load_lock = threading.Lock()
        # engine-thread state
        self._pending: deque[_Call | _Control] = deque()
        self._live: dict[tuple[str, int], tuple[_Call, int]] = {}
        # rows not yet sent to a rank, the rank of each row sent, cancels for each rank
        self._batch: list[tuple[_Call, int]] = []
        self._rank_of: dict[tuple[str, int], int] = {}
        self._rank_cancels: list[list[tuple[str, int]]] = [[] for _ in range(self.replica.size)]
        self._turn = 0
        self._counts = (0, 0)  # (running, waiting) rows, for health()
        self._in_ranks = (0, 0)  # (running, waiting) rows in the ranks' decoders after the last step
        self._last_step = time.monotonic()
        self._last_sampled = 0.0  # time.monotonic() of the last step that sampled
        # Seconds of a step that sampled, averaged over recent ones: every running row gets a token a step, so its
        # inverse is the per-row decode rate clients derive deadlines from.
        self._step_seconds: float | None = None
        self._tokens = self.metrics[M.ROLLOUT_GENERATION_TOKENS]
        self._ttft, self._itl = self.metrics[M.ROLLOUT_TIME_TO_FIRST_TOKEN], self.metrics[M.ROLLOUT_INTER_TOKEN_LATENCY]
        self._swaps_in_flight, self._rows_at_swap = self.metrics[M.ROLLOUT_SWAPS_IN_FLIGHT], self.metrics[M.ROLLOUT_ROWS_AT_SWAP]
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    # ---- the contract ------------------------------------------------------------------------------------
    @property
    def model(self) -> MoETransformer | None:
        return self.replica.model

    @property
    def version(self) -> int | None:
        """The weight version rows admitted now sample from (set by the engine thread as it swaps)."""
        return self.replica.version

    def submit(self, rows: list[RowRequest], on_tokens: Callable[[list[TokenEvent]], None] | None = None
               ) -> Future[list[RowOutput]]:
        """Queue `rows`; they join the running batch at the next step. `on_tokens` is called from the engine
        thread once per step in which any of the rows sampled, with their tokens of that step; a row's tokens
        arrive in order (a row may have two in one step: its prompt's last prefill chunk and a decode), before its
        Future resolves. The Future resolves with one RowOutput per row,
        in order, once all have finished (cancelled rows with finish_reason "abort"); it fails only if the engine
        cannot serve at all (no weights loaded yet, stopped)."""
        if not rows:
            raise ValueError("rows: an empty list; submit at least one row")
        call = _Call(list(rows), on_tokens, outputs=[None] * len(rows), left=len(rows), sampled=[0] * len(rows))
        self._put(call)
        return call.future

    def cancel(self, request_id: str, rows: Iterable[int] | None = None) -> None:
        """Finish the request's rows (all, or those listed) with "abort" at the next step; their slots and
        KV-cache blocks are freed. Idempotent, thread-safe; rows already finished are left as they are."""
        with self._lock:
            self._cancels.append((request_id, None if rows is None else frozenset(rows)))
            self._wake.notify()

    @property
    def lineage(self) -> int | None:
        """The lineage of the served version (protocol.VersionRef: numbers repeat across trainer restarts)."""
        return self.replica.lineage

    def load_version(self, version: int | VersionRef) -> float:
        """Fetch `version`, read it while serving goes on, swap it in between steps; returns seconds. A plain
        number means that version of the store's newest lineage (as `WeightStore.fetch` reads it); the same number
        of another lineage is other weights and is loaded."""
        with self._load_lock:
            ref = version if isinstance(version, VersionRef) else VersionRef(self._newest_lineage(), version)
            if (ref.lineage, ref.version) == (self.lineage, self.version):
                return 0.0
            start = time.monotonic()
            fetched = self.store.fetch(ref, self.cache_dir)
            try:
                self._control("begin_read", ref.version, str(fetched), ref.lineage).result()  # this rank's share
                self._control("swap", ref.version, ref.lineage)
            finally:
                if fetched.is_relative_to(self.cache_dir):  # a download (S3): read into memory, no longer needed
                    shutil.rmtree(fetched, ignore_errors=True)
            self.metrics[M.ROLLOUT_WEIGHT_VERSION].set(ref.version)
            seconds = time.monotonic() - start
            self.metrics[M.WEIGHT_LOAD_SECONDS].set(seconds)
            log.info("loaded weight version %d (lineage %d) in %.2f s", ref.version, ref.lineage, seconds)
            return seconds

    def _newest_lineage(self) -> int:
        latest = self.store.latest()
        return latest.lineage if latest is not None else 0

    def health(self) -> EngineHealth:
        running, waiting = self._counts
        with self._lock:
            waiting += sum(len(item.rows) for item in self._inbox if isinstance(item, _Call))
        rate = 1.0 / self._step_seconds if self._step_seconds else None
        return EngineHealth(self.version, running, waiting, self._last_step, self.lineage, rate)

    def stop(self) -> None:
        """End the loop: rows still running finish with "abort"; the replica stops (and its other ranks)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # ---- callers' side -----------------------------------------------------------------------------------
    def _put(self, item: _Call | _Control) -> None:
        with self._lock:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("the rollout engine is stopped")
            self._inbox.append(item)
            self._wake.notify()

    def _control(self, op: str, *args):
        item = _Control(op, args)
        self._put(item)
        return item.done.result()

    # ---- the engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception:  # noqa: BLE001 -- a bug in the loop: fail what is queued rather than hang callers
            log.exception("rollout engine loop failed")
            self._abort_all("the rollout engine failed; see its log")
        finally:
            self.replica.stop()

    def _iterate(self) -> bool:
        with self._lock:
            while not (self._inbox or self._cancels or self._stopping or self._pending or self._has_work()):
                self._last_step = time.monotonic()
                self._wake.wait(timeout=1.0)
            self._pending.extend(self._inbox)
            cancels, stopping = self._cancels, self._stopping
            self._inbox, self._cancels = [], []
        if stopping:
            self._abort_all("the rollout engine stopped")
            return False
        self._admit_pending()
        for request_id, rows in cancels:
            self._cancel(request_id, rows)
        if self._has_work():
            start = time.monotonic()
            try:
                produced = self._step()
            except Exception as exc:  # noqa: BLE001 -- a failed step (out of memory, ...) fails its rows, not the server
                log.exception("a decode step failed; its rows finish with an error")
                produced = self._fail_running(f"decoding failed: {type(exc).__name__}: {exc}")
            elapsed = time.monotonic() - start
            if produced:
                self._step_seconds = elapsed if self._step_seconds is None else (
                    STEP_AVERAGE_WEIGHT * elapsed + (1 - STEP_AVERAGE_WEIGHT) * self._step_seconds)
            self._count_busy(elapsed)
            self.metrics[M.ROLLOUT_STEPS].inc()
            self.metrics[M.ROLLOUT_TOKENS_PER_SECOND].set(produced / max(elapsed, 1e-9))
        self._last_step = time.monotonic()
        running, waiting = self._in_ranks
        self._counts = (running + len(self._batch),
                        waiting + sum(len(c.rows) for c in self._pending if isinstance(c, _Call)))
        return True

    def _report_ranks(self, reports: list[RankReport]) -> None:
        """The ranks' decoders after a step: rows for health(), KV-cache blocks, preemptions for the metrics, and
        the step's device seconds (the slowest rank's: the ranks step together), counted with its busy time."""
        self._in_ranks = (sum(r.running for r in reports), sum(r.waiting for r in reports))
        self._step_device_seconds = max((r.device_seconds for r in reports), default=0.0)
        total = sum(r.blocks_total for r in reports)
        self.metrics[M.ROLLOUT_KV_CACHE_USAGE].set(sum(r.blocks_used for r in reports) / total if total else 0)
        self.metrics[M.ROLLOUT_PREEMPTIONS].inc(sum(r.preemptions for r in reports))

    def _count_busy(self, elapsed: float) -> None:
        """A step's wall seconds, then its device seconds: a reader of the counters between the two increments
        (the metrics are read from other threads; a step's rows are delivered before it is counted) sees no more
        device time than busy time, as it would not if the device's were counted inside the step."""
        self.busy_seconds += elapsed
        self.metrics[M.ROLLOUT_BUSY_SECONDS].inc(elapsed)
        self.metrics[M.ROLLOUT_DEVICE_SECONDS].inc(self._step_device_seconds)
        self._step_device_seconds = 0.0

    def _fail_running(self, message: str) -> int:
        """Finish every row sent to the replica with finish_reason "error" (with the tokens it had, where the
        replica holds it), and let the replica start over with a fresh decoder (its cache may hold half a step)."""
        outputs = {(o.request_id, o.row): o for o in self.replica.finish_all("error", message)}
        for key in list(self._rank_of):
            call, index = self._live[key]
            if key in outputs:
                self._deliver(call, index, outputs[key])
            else:
                self._finish_unstarted(call, index, "error", message)
        self._rank_of.clear()
        self._rank_cancels = [[] for _ in range(self.replica.size)]
        self._report_ranks([])  # no cache until the next decoder is built
        return 0

    def _has_work(self) -> bool:
        return bool(self._batch or self._rank_of)

    def _admit_pending(self) -> None:
        """Queue submitted rows, in order, for the next step to send to the ranks; a drained swap waits until no
        row runs, and holds what follows."""
        while self._pending:
            item = self._pending[0]
            if isinstance(item, _Control):
                if item.op == "swap" and self._has_work() and self.run.weight_swap == "drain":
                    return
                self._pending.popleft()
                self._run_control(item)
                continue
            self._pending.popleft()
            if self.model is None:
                item.future.set_exception(RuntimeError("no weights loaded yet"))
                continue
            for index, request in enumerate(item.rows):
                if (request.request_id, request.row) in self._live:
                    self._finish_unstarted(item, index, "error",
                                           "a row with this request_id and row is already running")
                else:
                    self._live[(request.request_id, request.row)] = (item, index)
                    self._batch.append((item, index))
            for index in sorted(item.cancelled):
                self._cancel_one(item.rows[index].request_id, item.rows[index].row)

    def _max_len(self) -> int:
        """Positions of a row: the longest prompt and completion a request may ask for."""
        s = self.run.rl.sampling
        return min(self.run.model.max_position_embeddings, s.max_prompt_tokens + self.run.rollout.max_new_tokens)

    def _eos_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_ids)

    def _run_control(self, item: _Control) -> None:
        try:
            running = self._in_ranks[0]
            result = getattr(self.replica, item.op)(*item.args)
            if item.op == "swap" and running:  # in flight: those rows' next tokens are the new version's
                self._swaps_in_flight.inc()
                self._rows_at_swap.inc(running)
            elif item.op == "swap" and not self._has_work():
                # a step without rows: the first version's decoders are built now, not at a request
                self._report_ranks(self.replica.step(self._plan([[] for _ in range(self.replica.size)])))
            item.done.set_result(result)
        except Exception as exc:  # noqa: BLE001 -- report to the loader, keep serving the old version
            item.done.set_exception(exc)

    def _cancel(self, request_id: str, rows: frozenset[int] | None) -> None:
        for key in [k for k in self._live if k[0] == request_id and (rows is None or k[1] in rows)]:
            self._cancel_one(*key)
        for item in self._pending:  # not admitted yet (held behind a swap): cancelled on admission
            if isinstance(item, _Call):
                item.cancelled.update(i for i, r in enumerate(item.rows)
                                      if r.request_id == request_id and (rows is None or r.row in rows))

    def _cancel_one(self, request_id: str, row: int) -> None:
        call, index = self._live.get((request_id, row), (None, None))
        if call is None:
            return
        if (request_id, row) in self._rank_of:  # its rank cancels it at the next step
            self._rank_cancels[self._rank_of[(request_id, row)]].append((request_id, row))
        else:  # not sent to a rank yet
            self._batch.remove((call, index))
            self._finish_unstarted(call, index, "abort")

    def _plan(self, admit: list[list[RowRequest]]) -> StepPlan:
        cancels, self._rank_cancels = self._rank_cancels, [[] for _ in range(self.replica.size)]
        return StepPlan(admit, cancels, rows_per_rank(self.run, self.replica.size), self._max_len(), self._eos_ids())

    def _step(self) -> int:
        """One step of the replica: new rows go to the ranks with the fewest rows (a request's rows of one prompt
        together, so they share a prefill there), then every rank steps its own decoder."""
        size = self.replica.size
        load = [0] * size
        for rank in self._rank_of.values():
            load[rank] += 1
        admit: list[list[RowRequest]] = [[] for _ in range(size)]
        previous = None
        for call, index in self._batch:
            request = call.rows[index]
            if previous is None or previous[0] is not call or previous[1] != request.prompt_ids:
                # the least loaded rank; among equals the next in turn, so light traffic still uses them all
                rank = min(range(size), key=lambda r: (load[r], (r - self._turn) % size))
                self._turn = (rank + 1) % size
            previous = (call, request.prompt_ids)
            admit[rank].append(request)
            load[rank] += 1
            self._rank_of[(request.request_id, request.row)] = rank
        self._batch = []
        reports = self.replica.step(self._plan(admit))
        sampled = [token for report in reports for token in report.sampled]
        self._emit(sampled)  # all ranks' tokens of the step at once: one step, one inter-token latency
        for report in reports:
            for out in report.finished:
                del self._rank_of[(out.request_id, out.row)]
                call, index = self._live[(out.request_id, out.row)]
                self._deliver(call, index, out)
        self._report_ranks(reports)
        return len(sampled)

    def _emit(self, sampled: list[tuple[str, int, int, float, list[tuple[int, float]] | None]]) -> None:
        """One step's tokens (request id, row, token, logprob, alternatives): counted, and handed to each call that
        asked for them in one `on_tokens` call. Tokens leave when the step ends, so that is their time: a row's
        first token counts from its submission; a later one from the step before (every running row samples in
        every step), or 0 when the row's previous token came in this same step (a prefill finished, then the
        step's decode ran)."""
        if not sampled:
            return
        now = time.monotonic()
        bursts: dict[_Call, list[TokenEvent]] = {}
        first, fresh, again, live = [], set(), 0, self._live
        for request_id, row, token, logprob, top in sampled:  # every running row, every step: lookups kept local
            call, index = live[(request_id, row)]
            count = call.sampled[index]
            if not count:
                first.append(now - call.submitted)
                fresh.add((request_id, row))
            elif count == 1 and (request_id, row) in fresh:
                again += 1
            call.sampled[index] = count + 1
            if call.on_tokens is not None:
                bursts.setdefault(call, []).append(TokenEvent(request_id, row, token, logprob, top))
        self._tokens.inc(len(sampled))
        for seconds in first:
            self._ttft.observe(seconds)
        if again:
            self._itl.observe(0.0, again)
        if len(sampled) > len(first) + again:
            self._itl.observe(now - self._last_sampled, len(sampled) - len(first) - again)
        self._last_sampled = now
        for call, events in bursts.items():
            try:
                call.on_tokens(events)
            except Exception:  # noqa: BLE001 -- a listener's bug must not stop other rows
                log.exception("on_tokens failed for request %s", events[0].request_id)

    def _finish_unstarted(self, call: _Call, index: int, reason: str, error: str | None = None) -> None:
        """Report a row that produced nothing: cancelled before it ran, or refused (`error` says why)."""
        request = call.rows[index]
        self._deliver(call, index, RowOutput(request.request_id, request.row, [], [], None, reason, error, None,
                                             self.version, self.lineage or 0))

    def _deliver(self, call: _Call, index: int, out: RowOutput) -> None:
        self._live.pop((out.request_id, out.row), None)
        if call.outputs[index] is not None:
            return
        call.outputs[index] = out
        call.left -= 1
        if call.left == 0:
            call.future.set_result(call.outputs)

    def _abort_all(self, reason: str) -> None:
        """Finish every row with "abort" (with the tokens it had, where this process's rank holds it) and fail
        what is queued with `reason`."""
        outputs = {(o.request_id, o.row): o for o in self.replica.finish_all("abort")}
        for key, (call, index) in list(self._live.items()):
            if key in outputs:
                self._deliver(call, index, outputs[key])
            else:
                self._finish_unstarted(call, index, "abort")
        self._batch.clear()
        self._rank_of.clear()
        with self._lock:
            self._pending.extend(self._inbox)
            self._inbox = []
        for item in self._pending:
            target = item.future if isinstance(item, _Call) else item.done
            if not target.done():
                target.set_exception(RuntimeError(reason))
        self._pending.clear()
