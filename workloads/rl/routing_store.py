"""Routing store: where rollout servers put the routed expert ids of each choice (routing replay, R3) and trainer
ranks read them, so the arrays never cross the orchestrator or a JSON body: the wire carries a `RoutingRef` (key,
dtype, shape, bytes, checksum; protocol.py).

One object per choice, `<root>/<key>`: the C-order ids [prompt + completion - 1, layers, k] as uint8 (<= 256
experts) or int16, optionally zlib-compressed (rl.routing.compression), no header (the reference says what they
are). A writer puts the bytes in a temporary file beside it and renames it into place, so a reader sees all of an
object or none; there is no fsync: a lost or torn object fails its reader's size or XXH3 check by name, and the
orchestrator's state never outlives the objects it refers to by more than a lost step.

When objects go (the orchestrator deletes them: it alone knows when nothing needs them any more):
- a batch's, once a trainer checkpoint past its step is committed (the trainer's next `GET /v1/batch` says so:
  `committed` > step), i.e. trained AND checkpointed: a trainer restarted from that checkpoint never asks for it;
- a group's that will never train, when the orchestrator learns it: dynamic sampling filtered it, too few rewards
  succeeded, it went stale, it arrived twice, its batch was dropped for a restarted trainer's lineage, or a
  restored state no longer holds it; a sample whose reward failed, at once;
- an object no state refers to (a hedge's losing answer, an answer whose caller gave up or died) once it is
  `rl.routing.orphan_after_s` old (`sweep`).

Locking rule: none is needed; every object is written once under a key no other writer uses, and deleted once.
"""
from __future__ import annotations

import os
import time
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.run import RunConfig

from ..model.safetensors_io import xxh3
from .protocol import ROUTING_DTYPES, ROUTING_KEY, ProtocolError, RoutingRef, routing_dtype

ZLIB_LEVEL = 1  # the fastest: expert ids are nearly incompressible past it, and the writer is on a request's path


class RoutingStore:
    def __init__(self, root: str | Path, compression: str = "none", registry: Any = None) -> None:
        """`registry`: the role's Prometheus registry (runtime.Registry), counting the bytes this process moves."""
        self.root, self.compression = Path(root), compression
        self._registry = registry

    @classmethod
    def of(cls, run: RunConfig, registry: Any = None) -> "RoutingStore":
        from .runtime import output_dir

        cfg = run.rl.routing
        return cls(cfg.directory(str(output_dir(run))), cfg.compression, registry)

    def _count(self, metric, n: int) -> None:
        if self._registry is not None and n:
            self._registry[metric].inc(n)

    # ---- the rollout server's side ----------------------------------------------------------------------------
    def write(self, key: str, ids: Any, num_experts: int) -> RoutingRef:
        """Store expert ids [positions, layers, k] (any integer array) under `key` and return their reference."""
        import numpy as np

        if not ROUTING_KEY.match(key):
            raise ProtocolError("key", key, "1-200 letters, digits, '_', '.', '-'")
        a = np.asarray(ids)
        if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
            raise ProtocolError("routing", f"{a.dtype}{list(a.shape)}", "integer expert ids [positions, layers, k]")
        if a.size and (a.min() < 0 or a.max() >= num_experts):
            raise ProtocolError("routing", f"ids in [{a.min()}, {a.max()}]", f"expert ids in [0, {num_experts})")
        dtype = routing_dtype(num_experts)
        data = memoryview(np.ascontiguousarray(a, dtype=dtype)).cast("B")
        if self.compression == "zlib":
            data = memoryview(zlib.compress(data, ZLIB_LEVEL))
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.root / key)
        self._count(M.ROUTING_BYTES_WRITTEN, len(data))
        return RoutingRef(key, dtype, tuple(a.shape), len(data), xxh3(data), self.compression)

    # ---- the trainer's side ---------------------------------------------------------------------------------
    def read(self, ref: RoutingRef, path: str = "routing", model: Any = None):
        """The ids `ref` names, as a read-only numpy array of its dtype and shape; a reference that does not match
        its object (or `model`, the trained ModelConfig: its layers, experts per token and id type) raises
        ProtocolError naming the field at `path`."""
        import numpy as np

        if model is not None:
            if tuple(ref.shape[1:]) != (model.num_hidden_layers, model.num_experts_per_tok):
                raise ProtocolError(f"{path}.shape", list(ref.shape), f"[positions, {model.num_hidden_layers} "
                                    f"layers, {model.num_experts_per_tok} experts per token] (the trained model's)")
            if ref.dtype != routing_dtype(model.num_experts):
                raise ProtocolError(f"{path}.dtype", ref.dtype, f"{routing_dtype(model.num_experts)}, the id type "
                                    f"of {model.num_experts} experts")
        try:
            data = (self.root / ref.key).read_bytes()
        except FileNotFoundError:
            raise ProtocolError(f"{path}.key", ref.key, f"an object in the routing store {self.root}: there is "
                                "none (deleted, or written to another rl.routing.path)") from None
        self._count(M.ROUTING_BYTES_READ, len(data))
        if len(data) != ref.bytes:
            raise ProtocolError(f"{path}.bytes", ref.bytes, f"the object's size, {len(data)} bytes (torn or "
                                "rewritten)")
        if xxh3(data) != ref.checksum:
            raise ProtocolError(f"{path}.checksum", ref.checksum, f"the object's XXH3-64, {xxh3(data)} "
                                "(its bytes changed since they were written)")
        if ref.compression == "zlib":
            try:
                data = zlib.decompress(data)
            except zlib.error as exc:
                raise ProtocolError(f"{path}.compression", ref.compression, f"zlib data ({exc})") from None
        if len(data) != ref.array_bytes:
            raise ProtocolError(f"{path}.shape", list(ref.shape), f"{len(data) // ROUTING_DTYPES[ref.dtype]} ids "
                                f"of {ref.dtype} as stored")
        return np.frombuffer(data, dtype=ref.dtype).reshape(ref.shape)

    # ---- the orchestrator's side ----------------------------------------------------------------------------
    def delete(self, refs: Iterable[RoutingRef]) -> int:
        """Remove these objects (those already gone are skipped); returns the bytes removed."""
        removed = 0
        for ref in refs:
            try:
                (self.root / ref.key).unlink()
            except FileNotFoundError:
                continue
            removed += ref.bytes
        self._count(M.ROUTING_BYTES_DELETED, removed)
        return removed

    def sweep(self, live: set[str], older_than_s: float, now: float | None = None) -> int:
        """Remove every object (and writer's temporary file) not in `live` whose last write is older than
        `older_than_s`; returns the bytes removed."""
        cutoff = (time.time() if now is None else now) - older_than_s
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if entry.name in live or not (ROUTING_KEY.match(entry.name) or entry.name.endswith(".tmp")):
                continue
            try:
                st = entry.stat()
                if st.st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += st.st_size
            except FileNotFoundError:
                continue
        self._count(M.ROUTING_BYTES_DELETED, removed)
        return removed
