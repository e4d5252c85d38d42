"""The trainer's link to the orchestrator: where batches come from (`BatchSource`, over HTTP `HttpBatchSource`:
retried through orchestrator restarts, re-posting the newest version to one that lost it and handing its record of
the batches it trained to one restored from an older state) and the `Announcer`, which
tells the orchestrator of each weight version once the store holds it. Rank 0 alone talks to the orchestrator."""
from __future__ import annotations

import logging
import threading
import time
import urllib.error
from typing import Protocol

from ..rl.protocol import Batch, VersionRef, request_of
from ..rl.runtime import TRANSIENT_HTTP_ERRORS, http_json
from .publisher import Publisher

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    """Where the trainer's batches come from and where it reports versions (the orchestrator, over HTTP)."""

    def next_batch(self, step: int, committed: int, stopping) -> Batch | None:
        """The batch of `step`, waiting for it; None once `stopping()` is true. `committed`: the step of the
        newest committed checkpoint (older batches may be forgotten)."""

    def version_published(self, version: int, lineage: int) -> None: ...

    def state(self) -> dict | None:
        """What to keep in a trainer checkpoint so the source resumes with it."""


class HttpBatchSource:
    """The orchestrator over HTTP. A restarted orchestrator knows no trainer version (its budget is 0, no batch
    forms) and says so in its 202; so does one whose post of our newest version failed (it was down then): that
    version is posted again, so batches flow within one poll. One restored from a checkpoint's state older than our
    step (its own state file lost) refuses our step (409); it is handed our record of the batches we trained (the
    request ids of each step since our second newest committed checkpoint: the one it may have resumed from, when
    the newest was committed while it restarted), catches up, and serves our step. Locking rule: `_lock` guards
    `newest` (the announcer's thread posts, the trainer's thread polls); `trained` is the trainer thread's."""

    STATE_ATTEMPTS = 5  # /v1/state: an orchestrator blip at checkpoint time must not kill the trainer, nor hang it

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self.newest: VersionRef | None = None  # the newest version the trainer asked to post (posted or not)
        self.reannounced = 0
        self.trained: dict[int, list[str]] = {}  # step -> request ids of its batch (_forget_before)
        self._committed: tuple[int, int] | None = None  # (the committed step before the newest, the newest)

    def next_batch(self, step: int, committed: int, stopping) -> Batch | None:
        self._forget_before(committed)
        caught_up = False
        while not stopping():
            try:
                data = http_json("GET", f"{self.url}/v1/batch?step={step}&committed={committed}", timeout=60)
            except urllib.error.HTTPError as exc:
                refusal = f"orchestrator refused the batch request: {exc.code} {exc.read()!r}"
                if exc.code == 409 and not caught_up:  # it may be behind us: hand it our record, ask once more
                    caught_up = self._hand_record(step, refusal)
                    continue
                if exc.code < 500:  # the orchestrator refused this trainer's request: retrying cannot help
                    raise RuntimeError(refusal) from exc
                log.warning("orchestrator error (%s); retrying", exc)
                time.sleep(1)
                continue
            except TRANSIENT_HTTP_ERRORS as exc:
                log.warning("orchestrator unreachable (%s); retrying", exc)
                time.sleep(1)
                continue
            if data.get("samples"):
                batch = Batch.from_json(data)
                self.trained[step] = sorted({request_of(s.id) for s in batch.samples})
                return batch
            # {"ready": false, "trainer": ...}: not ready within the long poll; ask again, after re-posting our
            # version where the orchestrator holds an older one or none (it restarted)
            held = None if data.get("trainer") is None else VersionRef.from_json(data["trainer"])
            with self._lock:
                newest = self.newest
            if newest is None:
                time.sleep(0.5)  # answered at once (no version held): our first version is still being written
            elif held is None or held < newest:
                self._reannounce(newest, held)
        return None

    def _forget_before(self, committed: int) -> None:
        """Keep the record from the committed step before the newest on (an orchestrator resumes from one of
        those two)."""
        if self._committed is None or committed != self._committed[1]:
            self._committed = (committed if self._committed is None else self._committed[1], committed)
        for s in [s for s in self.trained if s < self._committed[0]]:
            del self.trained[s]

    def _hand_record(self, step: int, refusal: str) -> bool:
        """After a 409 for `step`: post our record of the batches before it. True once the orchestrator has
        caught up to `step`; raises (the refusal, and why the record did not help) where it cannot."""
        record = {s: ids for s, ids in self.trained.items() if s < step}
        if not record:
            raise RuntimeError(f"{refusal}; this trainer has trained no batch since it started, so it holds no "
                               "record to catch the orchestrator up with")
        try:
            answer = http_json("POST", f"{self.url}/v1/trained", {"batches": record}, timeout=60)
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                log.warning("orchestrator error on our record (%s); asking again", exc)
                time.sleep(1)
                return False
            raise RuntimeError(f"{refusal}; our record of steps {min(record)}..{max(record)} was refused too: "
                               f"{exc.code} {exc.read()!r}") from exc
        except TRANSIENT_HTTP_ERRORS as exc:
            log.warning("orchestrator unreachable with our record (%s); asking again", exc)
            time.sleep(1)
            return False
        if answer.get("next_step") != step:
            raise RuntimeError(f"{refusal}; after our record of steps {min(record)}..{max(record)} its next batch "
                               f"is step {answer.get('next_step')}, not ours ({step})")
        log.warning("the orchestrator was behind us (restored from an older state): it caught up to step %d from "
                    "our record of steps %d..%d", step, min(record), max(record))
        return True

    def _reannounce(self, newest: VersionRef, held: VersionRef | None) -> None:
        log.warning("the orchestrator holds %s, not our version %s (it restarted, or was down when we posted "
                    "it): posting it again", held, newest)
        try:
            self.version_published(newest.version, newest.lineage)
            self.reannounced += 1
        except TRANSIENT_HTTP_ERRORS as exc:
            log.warning("re-posting version %s failed (%s); asking again", newest, exc)
            time.sleep(1)

    def version_published(self, version: int, lineage: int) -> None:
        ref = VersionRef(lineage, version)
        with self._lock:  # first: if the post fails, the next 202 shows the orchestrator lacks it
            self.newest = max(self.newest or ref, ref)
        http_json("POST", f"{self.url}/v1/version", {"version": version, "lineage": lineage}, timeout=300)

    def state(self) -> dict | None:
        """The orchestrator's state, retried STATE_ATTEMPTS times (1, 2, 4, 8 s apart) when it does not answer or
        answers 5xx; then the checkpoint fails loudly, naming the orchestrator."""
        for attempt in range(self.STATE_ATTEMPTS):
            try:
                return http_json("GET", f"{self.url}/v1/state", timeout=60)
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    raise
                error = exc
            except TRANSIENT_HTTP_ERRORS as exc:
                error = exc
            if attempt + 1 < self.STATE_ATTEMPTS:
                log.warning("orchestrator state unavailable (%s); retrying", error)
                time.sleep(2 ** attempt)
        raise RuntimeError(f"{self.url}/v1/state did not answer in {self.STATE_ATTEMPTS} attempts (last: {error}); "
                           "the checkpoint cannot record the orchestrator's state")


class Announcer:
    """Rank 0: tells the batch source each weight version once rollout servers can load it: once the publisher
    has put it in the store, or sooner, once it is offered over device memory to the server on the trainer's GPU.

    Asynchronous runs (max_staleness >= 1): a thread announces versions as they land in the store, while the
    trainer goes on; an offered version is announced at once, since the orchestrator draws the next batch's
    prompts only after the version it waits for is announced (on the H200 at 8 layers of the 30B shape, waiting
    for the store write left the GPU idle 6 s a step). Synchronous runs (max_staleness 0): the next batch needs
    samples of the new version; `published(version)` announces it at once when offered, else waits for the store
    write, and returns before the trainer asks for that batch. A server that cannot take an announced version yet
    (not on this GPU, the store write still running) is told again by the orchestrator's health loop.
    Locking rule: `_lock` serialises the announcements (the trainer's thread and the announcing thread), so a
    version is announced once and never after a newer one."""

    def __init__(self, publisher: Publisher, source: BatchSource, lineage: int, *, background: bool) -> None:
        self.publisher, self.source, self.lineage = publisher, source, lineage
        self.announced: int | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="weights-announcer", daemon=True) if background else None
        if self._thread is not None:
            self._thread.start()

    def published(self, version: int, *, offered: bool = False) -> None:
        """The publisher took a snapshot of `version`. `offered`: the colocated server can take it from the
        trainer's GPU memory already, so a synchronous run announces it now rather than after the store write (on
        the H200 at 8 layers of the 30B shape that write was 15.5 s of a 103 s step); the store still gets it, as
        the path for other machines and restarts and the record of versions."""
        if offered:
            self._announce(version)
            return
        if self._thread is not None:
            return
        failures = self.publisher.failures
        seen = self.publisher.published
        while seen is None or seen < version:
            if self.publisher.failures > failures:
                raise RuntimeError(f"weight version {version} could not be written to the store; see the log")
            seen = self.publisher.wait_published(seen, timeout=1.0)
        self._announce(seen)

    def close(self) -> None:
        """After the publisher's close (everything written): stop the thread, announce the newest version."""
        self._closing = True
        if self._thread is not None:
            self._thread.join()
        self._announce(self.publisher.published)

    def _run(self) -> None:
        seen = None
        while not self._closing:
            seen = self.publisher.wait_published(seen, timeout=1.0)
            self._announce(seen)

    def _announce(self, version: int | None) -> None:
        with self._lock:
            if version is None or (self.announced is not None and version <= self.announced):
                return
            try:
                self.source.version_published(version, self.lineage)
                self.announced = version
            except Exception:  # noqa: BLE001 -- the announcing thread must survive: the next version tries again
                log.exception("announcing weight version %d failed", version)
