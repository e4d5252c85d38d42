"""Where a run's trainer checkpoints live and which is the newest: the layout of `<output>/checkpoints/` that the
trainer writes (workloads/trainer/checkpoint.py) and the orchestrator's `--resume latest` reads. Torch-free."""
from __future__ import annotations

from pathlib import Path

LATEST = "LATEST"  # a file naming the newest committed checkpoint's directory
ORCHESTRATOR_STATE = "orchestrator.json"  # in a checkpoint's directory: the orchestrator's state at its step


def staging_dir(root: Path, step: int) -> Path:
    return root / f".staging-step-{step:08d}"


def final_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: Path) -> Path | None:
    try:
        return root / (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
