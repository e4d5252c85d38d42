"""Weight versions between a trainer and a rollout server on the same GPU, through GPU memory (CUDA IPC).

The trainer (one rank) keeps one export of the served weights on its device: `DeviceExporter.export(ref, state)`
casts the state into it (each tensor in the dtype the store publishes it in, so a version is bit-equal whichever
path it takes) and offers that version. A server's `DeviceImporter.take(ref)` asks for it over a Unix socket
(abstract namespace, authenticated both ways with the run's weight token) and gets the export's tensors, sent by
torch's own reductions (torch.multiprocessing: a CUDA tensor travels as its IPC handle and is opened in the
server's process without a copy; a CPU tensor as a shared-memory file under the `file_system` sharing strategy,
so the same protocol runs between two processes without a GPU). The server copies them into its served tensors
(device to device) and releases them: the acknowledgement. Until every taker has released, the trainer does not
write the export again: a version published meanwhile is not offered, and servers read it from the store.

The store stays the record of versions and the path between machines: the trainer still publishes every version
there, and the orchestrator announces a version once it is in the store; a server asks here first and reads the
store when the version offered is another one (the trainer moved on, restarted, or is not listening yet).

Locking rule: `_cond` guards the offered version, the export's tensors and the count of takers; the copy into
the export runs outside it, with nothing offered (so no taker can hold it meanwhile).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import torch
import torch.multiprocessing  # registers torch's tensor reductions with the connections' pickler

from moe_rl_eks.core.run import ModelConfig, RunConfig

from ..model.checkpoint import published_dtype
from ..model.transformer import weights_dtype
from .protocol import VersionRef
from .runtime import output_dir

log = logging.getLogger(__name__)
TAKE, RELEASE = "take", "release"


def address(directory: Path) -> str:
    """The exporter's socket for the run writing into `directory`: an abstract Unix socket (no file to clean up
    after a crash, no path length limit) named after the directory, so a trainer and its servers agree on it."""
    digest = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:24]
    return f"\0moerl-weights-{digest}"


def channel(run: RunConfig) -> tuple[str, bytes] | None:
    """(address, key) of the run's device channel, or None when its versions go through the store alone: roles
    not colocated on one GPU or the channel turned off (RunConfig.weights_over_device), or no weight token in the
    environment to authenticate with (every local run has one)."""
    if not run.weights_over_device:
        return None
    token = os.environ.get(run.rl.weight_token_env)
    if not token:
        log.warning("%s is not set: weight versions go through the store, not device memory",
                    run.rl.weight_token_env)
        return None
    return address(output_dir(run)), token.encode()


class DeviceExporter:
    """The trainer's side: one export of the served weights on its device, offered to servers on `address`."""

    def __init__(self, config: ModelConfig, address: str, authkey: bytes) -> None:
        if torch.multiprocessing.get_sharing_strategy() != "file_system":
            # CPU tensors (tests, CPU runs) then travel as named shared-memory files an unrelated process can open;
            # CUDA tensors travel as IPC handles under either strategy.
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.config, self.serving = config, weights_dtype(config)
        self._cond = threading.Condition()
        self._export: dict[str, torch.Tensor] = {}
        self._offered: VersionRef | None = None
        self._takers = 0
        self.not_offered: list[VersionRef] = []  # published while a server held the export: store only
        self.export_seconds = 0.0
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._accepting = threading.Thread(target=self._accept, name="weights-exporter", daemon=True)
        self._accepting.start()

    @property
    def offered(self) -> VersionRef | None:
        with self._cond:
            return self._offered

    def export(self, ref: VersionRef, state: dict[str, torch.Tensor]) -> bool:
        """Copy `state` into the export and offer it as `ref` (False, and nothing copied, while a server still
        holds the previous version). Returns once the copy is complete on the device."""
        with self._cond:
            if self._takers:
                self.not_offered.append(ref)
                log.info("weight version %s not offered over device memory: a server still holds %s", ref,
                         self._offered)
                return False
            self._offered = None
        start = time.perf_counter()
        aliases: dict[tuple, str] = {}  # a tied lm_head is the embedding itself: exported once
        with torch.no_grad():
            for name, tensor in state.items():
                key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
                if key in aliases:
                    self._export[name] = self._export[aliases[key]]
                    continue
                aliases[key] = name
                target = self._export.get(name)
                dtype = published_dtype(name, tensor.dtype, self.serving)
                if target is None or target.shape != tensor.shape or target.dtype != dtype \
                        or target.device != tensor.device:
                    target = self._export[name] = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
                    if not target.is_cuda:
                        target.share_memory_()  # once: later versions reuse the same shared file
                target.copy_(tensor)
            for name in set(self._export) - set(state):
                del self._export[name]
        if any(t.is_cuda for t in self._export.values()):
            torch.cuda.current_stream().synchronize()  # the server's copies start on another process's stream
        self.export_seconds = time.perf_counter() - start
        with self._cond:
            self._offered = ref
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop answering, then wait (up to `timeout_s`) until no server holds the export: the memory a server
        maps is this process's, and goes when it exits."""
        self._listener.close()
        with self._cond:
            if not self._cond.wait_for(lambda: not self._takers, timeout_s):
                log.warning("a rollout server still holds weight version %s after %.0f s", self._offered, timeout_s)

    # ---- the exporter's thread ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            except Exception:  # noqa: BLE001 -- a peer that failed authentication: refuse it, keep listening
                log.warning("refused a connection to the weights exporter (authentication failed)")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="weights-exporter-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        """One take: answer the version's tensors (or None if another is offered), then wait for the release (or
        the server's end: a server that died releases too)."""
        held = False
        try:
            op, lineage, version = conn.recv()
            ref = VersionRef(int(lineage), int(version))
            with self._cond:
                if op == TAKE and self._offered == ref:
                    self._takers += 1
                    held = True
                    reply = (self.config, dict(self._export))
                else:
                    reply = None
            conn.send(reply)
            if held:
                conn.recv()
        except (EOFError, OSError, ValueError, TypeError):
            pass
        finally:
            if held:
                with self._cond:
                    self._takers -= 1
                    self._cond.notify_all()
            conn.close()


@dataclass
class Taken:
    """A version taken from the trainer's device: its config and tensors (the trainer's export, not a copy);
    `release()` once they are copied out. Until then the trainer offers no newer version."""

    ref: VersionRef
    config: ModelConfig
    state: dict[str, torch.Tensor]
    _conn: Connection

    def release(self) -> None:
        self.state.clear()  # every holder of this dict lets go of the export's tensors (their mappings)
        try:
            self._conn.send(RELEASE)
        except OSError:  # the trainer is gone: nothing to tell
            pass
        self._conn.close()


class DeviceImporter:
    """The server's side: take a version from the trainer on the same GPU, if it offers that version."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self.address, self.authkey = address, authkey

    def take(self, ref: VersionRef) -> Taken | None:
        """Version `ref` from the trainer's export, or None: no trainer listening, or it offers another version."""
        try:
            conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
        except (OSError, AuthenticationError) as exc:
            log.info("no weights exporter to take version %s from (%s): reading the store", ref, exc)
            return None
        try:
            conn.send((TAKE, ref.lineage, ref.version))
            reply = conn.recv()  # opens the export's IPC handles (or shared-memory files)
        except Exception as exc:  # noqa: BLE001 -- the trainer went away, or its memory cannot be opened here
            conn.close()
            log.warning("taking version %s from the trainer's device memory failed (%s: %s): reading the store",
                        ref, type(exc).__name__, exc)
            return None
        if reply is None:
            conn.close()
            log.info("the weights exporter offers another version than %s: reading the store", ref)
            return None
        config, state = reply
        return Taken(ref, config, state, conn)
