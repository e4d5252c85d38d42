"""Trainer checkpoints: model shard, optimizer, RNG states per rank; step, weight version and the orchestrator's
state (data cursor, buffered and in-flight groups, served batches) from rank 0. Written into a staging directory
and renamed into place once every rank has finished, so a crash mid-write leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from .weights import fsync

LATEST = "LATEST"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".staging-step-{step:08d}"


def final_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def write_rank(root: Path, step: int, rank: int, model_state: dict, optimizer_state: dict) -> None:
    path = staging_dir(root, step) / f"rank{rank}.pt"
    torch.save({"model": model_state, "optimizer": optimizer_state, "rng": rng_state()}, path)
    fsync(path)


def commit(root: Path, step: int, meta: dict, orchestrator_state: dict | None, keep: int = 2) -> Path:
    """Rank 0, after every rank wrote its file: add the metadata, rename into place, point LATEST at it."""
    staging, final = staging_dir(root, step), final_dir(root, step)
    (staging / "trainer.json").write_text(json.dumps(meta, indent=1))
    if orchestrator_state is not None:
        (staging / "orchestrator.json").write_text(json.dumps(orchestrator_state))
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


def latest(root: Path) -> Path | None:
    try:
        return root / (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def read_rank(directory: Path, rank: int) -> dict:
    path = directory / f"rank{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint has no file for rank {rank} (was it written with another "
                                f"number of ranks?)")
    return torch.load(path, weights_only=False)
