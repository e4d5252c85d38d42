"""How a serving replica takes in a weight version: read into host staging, then install into the served tensors.

The GPU holds the served weights and a KV cache sized to what they leave free, so a whole second copy of a version
does not fit there; and no served tensor may change before the whole version is read and verified (a sharded
server swaps all or none, and a failed version leaves the previous one served). So a version is read, every
tensor's checksum verified as its bytes arrive, into host buffers that are pinned when a GPU is there
(`HostStaging`); only then are they copied into the served tensors in place (`install`: asynchronous copies on a
side stream, one wait), which keeps the decoder's CUDA graphs valid. Bytes go disk -> pinned host -> GPU: no
pageable copy and no second host copy.

The buffers (one per safetensors file) are kept from one version to the next: pinning takes seconds (the pages are
faulted in and locked), paid on the first load only, and a version of the same model has the same files. That
costs this rank's share of the published weights in host memory for the server's life. Without a GPU the same
path runs with plain buffers.
"""
from __future__ import annotations

import logging
import mmap
import threading
from pathlib import Path

import torch

from moe_rl_eks.core.run import ModelConfig

from ..model.checkpoint import load_hf

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE


class HostStaging:
    """Host buffers a replica reads weight versions into, one per safetensors file, kept across versions;
    registered with CUDA (pinned in place, as the publisher's snapshots are: torch's pinned allocator would round
    each file up to a power of two) when `pin`. Called by load_hf's reader threads, one file each."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()
        self._used: set[str] = set()  # files the read in progress asked for
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, name: str, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._used.add(name)
            buffer = self.buffers.get(name)
            if buffer is not None and buffer.numel() == nbytes:
                return buffer
            self._drop(name)
        # An anonymous mapping: whole pages of its own (registering heap memory that shares a page with another
        # registered buffer would fail), and the storage starts where the registration does, so is_pinned() and
        # torch's copies see pinned memory. The tensor keeps the mapping alive.
        mapping = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))
        buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        pinned = self.pin and self._register(buffer, len(mapping))
        with self._lock:
            self.buffers[name] = buffer
            if pinned:
                self._pinned.add(name)
        return buffer

    def read(self, directory: str | Path, experts: range | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """A version's tensors (this rank's experts), verified, as views of the staging buffers; buffers of files
        the version does not have are freed."""
        self._used = set()
        config, state = load_hf(directory, experts=experts, into=self)
        with self._lock:
            for name in set(self.buffers) - self._used:
                self._drop(name)
        return config, state

    def close(self) -> None:
        """Unpin and free every buffer (no read may be running)."""
        with self._lock:
            for name in list(self.buffers):
                self._drop(name)

    def _register(self, buffer: torch.Tensor, nbytes: int) -> bool:
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if error and not self._warned:
            # Still correct, only slower (a staged copy to the GPU): say so once rather than refuse every version.
            self._warned = True
            log.warning("pinning %d bytes of host staging for weight versions failed (cudaError %d; is the "
                        "locked-memory limit, ulimit -l, too low?): loading from pageable memory", buffer.numel(),
                        error)
        return not error

    def _drop(self, name: str) -> None:  # under _lock
        buffer = self.buffers.pop(name, None)
        if buffer is not None and name in self._pinned:
            self._pinned.discard(name)
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def install(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a verified version into the model's tensors in place (every name of model.state_dict() must be in
    `state`, shapes checked before). On a GPU: asynchronous copies from the staging on a side stream, queued after
    the work already issued on the current stream (a step still reading the weights), and one wait."""
    served = model.state_dict()
    device = next(iter(served.values())).device
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None  # None: torch.cuda.stream() does nothing
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(stream):
        for name, tensor in served.items():
            tensor.copy_(state[name], non_blocking=cuda)
    if cuda:
        stream.synchronize()
