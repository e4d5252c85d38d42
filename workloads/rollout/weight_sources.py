"""Where a replica's next weight version comes from: the store, read into host staging (every server), or the
trainer's GPU memory when the trainer shares this server's GPU (workloads/rl/device_weights), with the store
behind it for a version the trainer no longer offers. Either way the replica gets the version's tensors to check
and install (weight_staging.install), then releases them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_rl_eks.core.run import ModelConfig

from ..rl.device_weights import DeviceImporter
from ..rl.protocol import VersionRef
from .weight_staging import HostStaging


@dataclass
class StagedVersion:
    """A version's tensors ready to install, how they came (`via`: "store" or "device"), and what to call once
    they are installed or refused (the device path's acknowledgement)."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    via: str
    release: Callable[[], None] = lambda: None


class VersionSource(ABC):
    @abstractmethod
    def read(self, ref: VersionRef, path: str, experts: range | None) -> StagedVersion:
        """Version `ref` (its files in the directory `path`), this rank's `experts` (None: all)."""

    @abstractmethod
    def close(self) -> None:
        """Free what the source keeps between versions (no read may be running)."""


class StoreSource(VersionSource):
    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging

    def read(self, ref: VersionRef, path: str, experts: range | None) -> StagedVersion:
        config, state = self.staging.read(path, experts)
        return StagedVersion(config, state, "store")

    def close(self) -> None:
        self.staging.close()


class DeviceSource(VersionSource):
    """The trainer's export of the version on this GPU (no disk, no host copy), else the store."""

    def __init__(self, importer: DeviceImporter, store: StoreSource) -> None:
        self.importer, self.store = importer, store

    def read(self, ref: VersionRef, path: str, experts: range | None) -> StagedVersion:
        taken = self.importer.take(ref) if experts is None else None
        if taken is None:
            return self.store.read(ref, path, experts)
        return StagedVersion(taken.config, taken.state, "device", taken.release)

    def close(self) -> None:
        self.store.close()
