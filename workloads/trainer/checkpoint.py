"""Trainer checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own shards (its experts
and their optimizer state; replicated weights once), the metadata records each tensor's global shape, so a
checkpoint loads on any number of trainer ranks: each reads the slices it owns now. Step, lineage, Python RNG and
the orchestrator's state (data cursor, buffered and in-flight groups, served batches) are JSON from rank 0.
Sharding the dense weights (rl.training.fsdp) changes no key and no global shape, only which rank writes which
slice, so the format is the same with and without it. trainer.json carries the layout's version
(protocol.CHECKPOINT_FORMAT); `read_meta` refuses one this code cannot read, naming the version found and the ones
it reads (a trainer.json without one is from before formats were recorded: format 1's layout, read where it has no
critic).

Written into a staging directory and renamed into place once every rank has finished, so a crash mid-write
leaves the previous checkpoint intact. Nothing is unpickled on load: tensors are read with torch.load's
weights-only loader (DCP's), and DCP's metadata file through an unpickler that admits only its own record types.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..rl.checkpoint_dirs import LATEST, ORCHESTRATOR_STATE, final_dir, staging_dir
from ..rl.protocol import CHECKPOINT_FORMAT, check_format
from ..rl.weights import fsync

DCP_RECORD_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


def python_rng_state() -> list:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def set_python_rng_state(state: list) -> None:
    version, values, gauss = state
    random.setstate((version, tuple(values), gauss))


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; admit only the classes it is made of (no arbitrary callables)."""

    def find_class(self, module: str, name: str):
        allowed = (module in DCP_RECORD_MODULES or (module, name) in (("pathlib", "PosixPath"),
                                                                      ("torch", "Size"),
                                                                      ("torch.serialization", "_get_layout"))
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP metadata "
                                         "file never holds; refusing to load it")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata holds {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def prepare(root: Path, step: int, rank: int, world: int) -> Path:
    """Rank 0 makes an empty staging directory; every rank gets its path once it exists."""
    staging = staging_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    if world > 1:
        dist.barrier()
    return staging


def save(state: dict[str, torch.Tensor], staging: Path, *, asynchronous: bool,
         group: dist.ProcessGroup | None = None) -> Future | None:
    """Write this rank's part of `state` (flat: name -> tensor or DTensor) into `staging`. Asynchronous: the
    tensors are copied to host memory before this returns, written by a background thread; the Future resolves
    once the checkpoint (every rank's files and the metadata) is complete. `group`: the process group DCP
    coordinates over (None: the default group); an asynchronous save needs one with a CPU backend."""
    with _quiet_when_alone():
        if asynchronous:
            return dcp.async_save(state, checkpoint_id=str(staging), process_group=group)
        dcp.save(state, checkpoint_id=str(staging), process_group=group)
    return None


def load(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Fill `state` (shaped for THIS run's ranks: DTensor shards or whole tensors) in place from `directory`."""
    with _quiet_when_alone():
        dcp.load(state, storage_reader=SafeReader(str(directory)))


@contextlib.contextmanager
def _quiet_when_alone():
    """With no process group (one trainer process: tests, tools) DCP saves and loads alone by itself, and warns
    so on every call, hence the filter."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class CheckpointFormatError(ValueError):
    """A checkpoint written in a layout this code does not read."""


def read_meta(directory: Path, *, critic: bool) -> dict:
    """A checkpoint's trainer.json, refused before any tensor is read when its format is not one this code reads.
    `critic`: the resuming run trains PPO's critic, which a format-1 checkpoint holds as a linear value head that
    the critic of format 2 cannot be loaded from; a format-1 checkpoint is otherwise read as it is (the policy's
    layout is unchanged)."""
    path = directory / "trainer.json"
    meta = json.loads(path.read_text())
    found = meta.get("format", 1)
    if type(found) is not int:
        problem = f"an integer format >= 1 (this code writes {CHECKPOINT_FORMAT})"
    elif found == 1 and critic:
        problem = ("format 1 holds PPO's critic as a linear value_head; this code's critic is a two-layer MLP "
                   "(format 2) and cannot be loaded from it: start the PPO run afresh, or from its policy through "
                   "rl.training.init_from")
    else:
        problem = None if found == 1 else check_format(found, CHECKPOINT_FORMAT, "checkpoint", "checkpoint")
    if problem is not None:
        raise CheckpointFormatError(f"{path}: format {found!r} is not readable here (this code reads checkpoint "
                                    f"formats 1 to {CHECKPOINT_FORMAT}): {problem}")
    return meta


def commit(root: Path, step: int, meta: dict, orchestrator_state: dict | None, keep: int = 2) -> Path:
    """Rank 0, after every rank's shards and the metadata are written: add the JSON (stamped with the format),
    rename into place, point LATEST at it, delete all but the newest `keep`."""
    staging, final = staging_dir(root, step), final_dir(root, step)
    (staging / "trainer.json").write_text(json.dumps({**meta, "format": CHECKPOINT_FORMAT}, indent=1))
    if orchestrator_state is not None:
        (staging / ORCHESTRATOR_STATE).write_text(json.dumps(orchestrator_state))
    for path in staging.iterdir():
        fsync(path)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(final.name)
    fsync(tmp)
    os.replace(tmp, root / LATEST)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final

