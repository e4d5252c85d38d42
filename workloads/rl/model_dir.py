"""A Hugging Face checkpoint directory used without an RL run: `moerl serve-rollout --model DIR` (evaluation,
smoke tests with OpenAI clients) and `moerl eval --model DIR`. The run configuration is derived from the
directory (config.json for the model, its tokenizer files for the tokenizer), and the directory itself is the
only weight version a server loads, read in place (no copy of tens of gigabytes)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moe_rl_eks.core import memory
from moe_rl_eks.core.run import TRITON_ROW_MULTIPLE, ModelConfig

from .protocol import VersionRef
from .weights import IncompleteVersion

MODEL_VERSION = 0  # the version number a server reports for the directory's weights
# As vLLM's defaults: rows decoded at once (each admitted as its KV-cache blocks allow), and the share of the GPU's
# memory the server may take (weights, KV cache, activations and CUDA graphs).
MAX_NUM_SEQS = 256
GPU_MEMORY_UTILIZATION = 0.9
CPU_MAX_NUM_SEQS = 64


def serving_compute(model: ModelConfig, cuda: bool) -> tuple[str, str]:
    """(moe_compute, why) a served checkpoint runs with by default: the triton kernels on a GPU, where its rows fit
    them (the run would refuse them otherwise); torch elsewhere."""
    if not cuda:
        return "torch", "no CUDA GPU (the triton kernels need one)"
    for name in ("hidden_size", "moe_intermediate_size"):
        size = getattr(model, name)
        if size % TRITON_ROW_MULTIPLE:
            return "torch", f"model.{name} ({size}) is not a multiple of {TRITON_ROW_MULTIPLE}, as triton's needs"
    return "triton", "a CUDA GPU, and the model's rows fit the triton kernels"


def kv_cache_positions(model: ModelConfig, *, gpu_bytes: int, utilization: float, max_len: int, gpus: int = 1) -> int:
    """KV-cache positions a server's share of one GPU (`utilization` x `gpu_bytes`) holds after the served weights
    and the CUDA overhead (core/memory.py). Refused (ValueError naming --gpu-memory-utilization and the numbers)
    when it cannot hold one row of `max_len` positions."""
    need = memory.rollout_memory(replicated=model.parameter_count() - model.routed_expert_parameter_count(),
                                 experts=model.routed_expert_parameter_count(), gpus=gpus,
                                 dtype_bytes=model.bytes_per_parameter, layers=model.num_hidden_layers,
                                 kv_heads=model.num_key_value_heads, head_dim=model.head_dim)
    have = utilization * gpu_bytes
    positions = int(have - need.fixed_bytes) // need.per_token_bytes
    if positions < max_len:
        raise ValueError(f"--gpu-memory-utilization: {utilization} of the GPU's {gpu_bytes / 2**30:.1f} GiB is "
                         f"{have / 2**30:.1f} GiB; the weights and CUDA overhead take {need.fixed_bytes / 2**30:.1f} "
                         f"GiB and one {max_len}-position row's KV cache {max_len * need.per_token_bytes / 2**30:.2f} "
                         "GiB more: raise it, or lower --max-new-tokens")
    return positions


def model_run_data(directory: str | Path, *, name: str | None = None, max_new_tokens: int | None = None,
                   max_model_len: int | None = None, gpus_per_server: int = 1, max_batch_size: int = CPU_MAX_NUM_SEQS,
                   moe_compute: str = "torch", numerics: str = "standard") -> dict:
    """A run file's contents (a mapping for core.schema.parse) for serving or evaluating `directory`: the model
    from its config.json, its tokenizer, rows (prompt and completion) up to `max_model_len` positions (default: the
    model's context; the engine's block tables and KV reservations are that wide), `max_new_tokens` of them at
    most (default: a quarter of the row, at most 8,192). Raises ValueError naming the limit that does not fit."""
    from ..model.checkpoint import CheckpointError, model_config

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; expected a Hugging Face checkpoint directory")
    model = model_config(json.loads(config_path.read_text()), source=str(config_path))
    context = model.max_position_embeddings
    if max_model_len is not None:
        if not 2 <= max_model_len <= context:
            raise ValueError(f"max_model_len: {max_model_len} positions; allowed 2..{context} (the model's "
                             f"max_position_embeddings in {config_path})")
        context = max_model_len
    if max_new_tokens is not None and not 1 <= max_new_tokens < context:
        raise ValueError(f"max_new_tokens: {max_new_tokens}; allowed 1..{context - 1}, leaving a row of {context} "
                         f"positions room for a prompt")
    new_tokens = max_new_tokens or min(8192, max(1, context // 4))
    return {"name": name or directory.resolve().name,
            "model": dataclasses.asdict(model), "moe_compute": moe_compute, "numerics": numerics,
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
