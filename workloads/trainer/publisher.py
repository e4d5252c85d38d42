"""Weight publication off the trainer's critical path.

`publish(version, state)` copies the state from the device into pinned host buffers that already are the
safetensors files' bytes (one asynchronous copy per tensor, cast to the published dtype on the device, all queued
before one wait) and returns; a background writer then writes those files into the store's staging area and
commits. A version still waiting when a newer one is published is superseded (its number is skipped): the trainer
never waits for the disk, and at most two snapshots exist (one being written, one waiting).

Under expert parallelism every rank publishes its own experts (rank 0 also the replicated weights) as its own
files of the same staged version; rank 0 commits once every rank's part is there (weights.WeightStore.stage).
Where several EP groups hold copies of the experts (EP over part of the ranks), the group with rank 0 writes them
and the others' publish() does nothing.
No collective runs in the background, so nothing overlaps the next step's collectives.

Locking rule: `_cond` guards the waiting snapshot, the free snapshots and their count, `published` and the closing
flag; the device copies, the pinning of a spare snapshot (by the writer, after its first write) and the file
writes run outside it.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moe_rl_eks.core.run import ModelConfig

from ..model.checkpoint import INDEX_FILE, hf_config, hf_sources, index_json, published_dtype, shard_name
from ..model.safetensors_io import FileLayout, fill, plan_files
from ..model.transformer import weights_dtype
from ..moe.parallel import ExpertParallel, local_experts
from ..rl.protocol import VersionRef
from ..rl.weights import WeightStore

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """One version's file images in host memory (pinned when a GPU is there)."""

    images: list[torch.Tensor]
    version: int | None = None


class Publisher:
    def __init__(self, store: WeightStore, config: ModelConfig, lineage: int, *, ep: ExpertParallel | None = None,
                 max_shard_bytes: int = 5 * 2**30, extra_files: Callable[[Path], None] | None = None) -> None:
        """`extra_files(directory)` adds a version's non-weight files (generation_config.json, tokenizer files)
        to rank 0's staging directory; config.json and the shard index are written here."""
        self.store, self.config, self.lineage, self.extra_files = store, config, lineage, extra_files
        self.experts = local_experts(ep, config.num_experts)
        self.rank, self.world = (ep.rank, ep.size) if self.experts is not None else (0, 1)
        self.writes = ep is None or ep.first_copy
        self.max_shard_bytes = max_shard_bytes
        self.serving = weights_dtype(config)
        self.layouts: list[FileLayout] | None = None
        self._shapes: dict | None = None
        self._cond = threading.Condition()
        self._waiting: Snapshot | None = None
        self._free: list[Snapshot] = []
        self._snapshots = 0  # made for the current layout: at most two
        self._pinned: list[torch.Tensor] = []  # registered with CUDA; unregistered by close()
        self._writing = False
        self._closing = False
        self._published: int | None = None
        self.superseded: list[int] = []  # versions skipped because a newer one came before they were written
        self._unmarked: list[int] = []  # of those, the ones the store has not been told about yet (EP)
        self.failures = 0
        self.snapshot_seconds = 0.0  # the last publish()'s critical-path time
        self.write_seconds = 0.0  # the last version written: its files, fsync and commit (not pinning a spare)
        self._writer = threading.Thread(target=self._write_loop, name="weights-publisher", daemon=True)
        self._writer.start()

    @property
    def published(self) -> int | None:
        """The last version that reached the store (rank 0; on other ranks, the last whose part was written)."""
        with self._cond:
            return self._published

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Snapshot `state` (this rank's, on its device) as version `version`; returns once the bytes are in host
        memory. The write happens in the background; a version still waiting is superseded."""
        start = time.perf_counter()
        if not self.writes:
            self.snapshot_seconds = 0.0
            return
        mine = {k: v for k, v in state.items() if self.rank == 0 or ".mlp.experts." in k}
        self._plan(mine)
        with self._cond:
            if self._closing:
                raise RuntimeError("publish() after close()")
            if self._waiting is not None:  # superseded: reuse its buffers
                snapshot, self._waiting = self._waiting, None
                self._skip(snapshot.version)
            elif self._free:
                snapshot = self._free.pop()
            else:  # the first publish: later ones find the spare the writer made
                snapshot = None
                self._snapshots += 1
        if snapshot is None:
            snapshot = self._allocate()
        cuda = any(t.is_cuda for t in mine.values())
        with torch.no_grad():
            for image, layout in zip(snapshot.images, self.layouts):
                fill(image, layout, mine, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream().synchronize()
        snapshot.version = version
        with self._cond:
            self._waiting = snapshot
            self._cond.notify_all()
        self.snapshot_seconds = time.perf_counter() - start

    def wait_published(self, seen: int | None, timeout: float | None = None) -> int | None:
        """Block until a version other than `seen` has reached the store (or the timeout, or close());
        returns `published`. Unlike flush(), this does not wait for a writer that a steady stream of newer
        versions keeps busy."""
        with self._cond:
            self._cond.wait_for(lambda: self._published != seen or self._closing and self._idle(), timeout)
            return self._published

    def _idle(self) -> bool:
        return self._waiting is None and not self._writing

    def flush(self) -> None:
        """Wait until the waiting snapshot, if any, has been written (or failed)."""
        with self._cond:
            self._cond.wait_for(self._idle)

    def close(self) -> None:
        """Write what is waiting, then stop the writer."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join()
        self._free.clear()
        self._unpin()

    def _unpin(self) -> None:
        for image in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(image.data_ptr())
        self._pinned.clear()

    # ---- internals -----------------------------------------------------------------------------------------
    def _plan(self, state: dict[str, torch.Tensor]) -> None:
        shapes = {k: (published_dtype(k, v.dtype, self.serving), tuple(v.shape)) for k, v in state.items()}
        if shapes == self._shapes:
            return
        with self._cond:  # a new shape (first publish): snapshots planned for the old one are useless
            self._cond.wait_for(self._idle)
            self._free.clear()
            self._snapshots = 0
            self._unpin()
        self._shapes = shapes
        names = shard_name if self.world == 1 else (
            lambda i, n: f"model-rank{self.rank:03d}-{i + 1:05d}-of-{n:05d}.safetensors")
        self.layouts = plan_files(hf_sources(shapes, self.config, self.experts), names,
                                  max_file_bytes=self.max_shard_bytes)

    def _allocate(self) -> Snapshot:
        images = [torch.empty(layout.size, dtype=torch.uint8) for layout in self.layouts]
        if torch.cuda.is_available():
            # Registered in place: torch's pinned allocator would round each file up to a power of two (a 5 GB
            # file would take 8 GB of locked memory).
            for image in images:
                error = int(torch.cuda.cudart().cudaHostRegister(image.data_ptr(), image.numel(), 0))
                if error:
                    raise RuntimeError(f"pinning {image.numel()} bytes of host memory for a weight snapshot failed "
                                       f"(cudaError {error}); the trainer needs two snapshots of its share of "
                                       "the published weights in host memory")
                self._pinned.append(image)
        return Snapshot(images)

    def _skip(self, version: int) -> None:
        self.superseded.append(version)
        self._unmarked.append(version)
        log.info("weight version %d superseded before it was written", version)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._closing)
                if self._waiting is None:
                    return
                snapshot, self._waiting = self._waiting, None
                self._writing = True
                skipped, self._unmarked = self._unmarked, []
            try:
                if self.world > 1:
                    for version in skipped:
                        self.store.skip(VersionRef(self.lineage, version), self.rank)
                self._write(snapshot)
            except Exception:  # noqa: BLE001 -- a failed version is logged and skipped; the next one may succeed
                self.failures += 1
                log.exception("publishing weight version %d failed", snapshot.version)
            finally:
                with self._cond:
                    self._free.append(snapshot)
                    spare = self._snapshots < 2 and not self._closing
                    self._snapshots += spare
                made = None
                if spare:  # pinning takes seconds: done here, once, not in the next publish()
                    try:
                        made = self._allocate()
                    except Exception:  # noqa: BLE001 -- the next publish() tries again (and raises)
                        log.exception("allocating the spare snapshot failed")
                with self._cond:
                    if made is not None:
                        self._free.append(made)
                    elif spare:
                        self._snapshots -= 1
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, snapshot: Snapshot) -> None:
        start = time.perf_counter()
        ref = VersionRef(self.lineage, snapshot.version)
        with self.store.stage(ref, part=self.rank, parts=self.world) as staging:
            if staging is None:
                return
            with ThreadPoolExecutor(min(8, len(self.layouts))) as pool:
                list(pool.map(lambda pair: staging.put(memoryview(pair[0].numpy()), pair[1]),
                              zip(snapshot.images, self.layouts)))
            if self.rank == 0:
                shards = dict(staging.facts)
                if self.world > 1:
                    shards.update(staging.collect_parts())
                (staging.directory / "config.json").write_text(json.dumps(hf_config(self.config), indent=2))
                if len(shards) > 1:
                    (staging.directory / INDEX_FILE).write_text(index_json(shards))
                if self.extra_files is not None:
                    self.extra_files(staging.directory)
                staging.facts.update(shards)
        with self._cond:
            self._published = snapshot.version
            self.write_seconds = time.perf_counter() - start
            self._cond.notify_all()
        log.info("published weight version %d in %.2f s", snapshot.version, self.write_seconds)
