"""A Hugging Face checkpoint directory used without an RL run: `moerl serve-rollout --model DIR` (evaluation,
smoke tests with OpenAI clients) and `moerl eval --model DIR`. The run configuration is derived from the
directory (config.json for the model, its tokenizer files for the tokenizer), and the directory itself is the
only weight version a server loads, read in place (no copy of tens of gigabytes)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .protocol import VersionRef
from .weights import IncompleteVersion

MODEL_VERSION = 0  # the version number a server reports for the directory's weights


def model_run_data(directory: str | Path, *, name: str | None = None, max_new_tokens: int | None = None,
                   gpus_per_server: int = 1, max_batch_size: int = 64) -> dict:
    """A run file's contents (a mapping for core.schema.parse) for serving or evaluating `directory`: the model
    from its config.json, its tokenizer, lengths up to the model's context (`max_new_tokens` default: a quarter of
    it, at most 8,192)."""
    from ..model.checkpoint import CheckpointError, model_config

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; expected a Hugging Face checkpoint directory")
    model = model_config(json.loads(config_path.read_text()), source=str(config_path))
    context = model.max_position_embeddings
    new_tokens = max_new_tokens or min(8192, max(1, context // 4))
    return {"name": name or directory.resolve().name,
            "model": dataclasses.asdict(model),
            "rollout": {"max_new_tokens": new_tokens, "gpus_per_server": gpus_per_server,
                        "max_batch_size": max_batch_size},
            "rl": {"sampling": {"tokenizer": str(directory), "max_tokens": new_tokens,
                                "max_prompt_tokens": max(1, context - new_tokens)},
                   # Nothing trains or orchestrates here, but the run must stay valid: a micro-batch holds the
                   # longest sample, and the deadline cap the longest request at the default floor rate.
                   "training": {"max_tokens_per_microbatch": max(context, 16384)},
                   "orchestrator": {"request_timeout_s": max(30.0, float(new_tokens) + 30.0)}}}


def model_run(directory: str | Path, **options):
    """The RunConfig of `model_run_data`, validated like a run file."""
    from moe_rl_eks.core.run import RunConfig
    from moe_rl_eks.core.schema import parse

    return parse(RunConfig, model_run_data(directory, **options), source=f"--model {directory}")


class ModelDirectoryStore:
    """The checkpoint directory standing in for a weight store (the part of it a rollout engine reads: `latest`
    and `fetch`) that holds one version, MODEL_VERSION, in lineage 0. Nothing can be published to it."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def publish(self, version: int, source: Path, *, lineage: int = 0) -> None:
        raise RuntimeError(f"{self.directory} is a model directory served as it is; nothing is published to it")

    def latest(self) -> VersionRef:
        return VersionRef(0, MODEL_VERSION)

    def fetch(self, ref: VersionRef | int, cache: Path) -> Path:
        if (ref if isinstance(ref, int) else ref.version) != MODEL_VERSION:
            raise IncompleteVersion(f"{self.directory} holds only version {MODEL_VERSION} (the checkpoint itself)")
        return self.directory
