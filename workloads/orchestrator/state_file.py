"""The orchestrator's own state file: written every step, so an orchestrator restarted alone continues where it
stopped (the trainer checkpoint's copy, `--resume`, is as old as the checkpoint).

Written before the trainer gets the batch it records (a restarted orchestrator knows every batch a trainer has
trained), atomically: the JSON goes to a temporary file beside it, is fsynced, and replaces the old file in one
rename, so a crash leaves the previous step's state, never half of one. Samples completed after the last write are
lost with the process (at most one step's worth); their prompts are issued again under the same request ids. Where
the file itself is lost (a fresh volume), `--resume` gives the checkpoint's older state and the trainer's record
catches it up (driver.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..rl.checkpoint_dirs import ORCHESTRATOR_STATE, latest
from ..rl.protocol import OrchestratorState
from ..rl.weights import fsync

STATE_FILE = "orchestrator-state.json"


def write_state(path: Path, state: OrchestratorState) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state.to_json()))
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)  # the rename itself survives a power loss


def read_state(path: Path) -> OrchestratorState | None:
    """The last state written at `path`, None where there is none (a fresh run)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return OrchestratorState.from_json(json.loads(text), path=str(path))


def checkpoint_state_path(checkpoints: Path) -> Path | None:
    """The orchestrator state of the run's newest committed trainer checkpoint (`checkpoints`: the run's
    <output>/checkpoints), None while there is no checkpoint."""
    newest = latest(checkpoints)
    return newest / ORCHESTRATOR_STATE if newest else None
