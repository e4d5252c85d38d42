"""`moerl serve-rollout`: the rollout server's process. Its run (a run file, or a Hugging Face checkpoint served as
it is, its batch and KV cache sized from the GPU's memory share), its replica (one process, or one per GPU under
torchrun), the weight source (the store, or the trainer's GPU memory when colocated), then the HTTP app of server.py
while the first published version loads."""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from moe_rl_eks.core.cluster import ROLLOUT_PORT

from ..rl.runtime import cap_gpu_memory, load, output_dir, serve
from .server import RolloutServer, make_app

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    import torch

    from .engine import RolloutEngine
    from ..rl.model_dir import CPU_MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, ModelDirectoryStore
    from .replica import Replica, follow
    from ..rl.tokenizer import load_tokenizer
    from ..rl.device_weights import DeviceImporter, channel as device_channel
    from ..rl.weights import open_store

    parser = argparse.ArgumentParser(prog="moerl serve-rollout",
                                     description="serve completions for a run, or a Hugging Face checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run configuration (configs/runs/<name>.yaml)")
    source.add_argument("--model", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer "
                        "files): served as it is, without a run, as version 0 under the directory's name")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="with --model: the completion length limit (default: a quarter of the context)")
    parser.add_argument("--max-model-len", type=_positions, default=None,
                        help="with --model: positions per row, prompt and completion (default: the model's "
                        "max_position_embeddings); the engine's block tables and each row's KV reservation are "
                        "this wide")
    parser.add_argument("--max-num-seqs", type=_count, default=None,
                        help=f"with --model: rows decoded at once, each admitted as its KV-cache blocks allow "
                        f"(default {MAX_NUM_SEQS} on a GPU, {CPU_MAX_NUM_SEQS} on the CPU)")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                        help=f"with --model on a GPU: the share of each GPU's memory the server may take (weights, "
                        f"KV cache, activations; default {GPU_MEMORY_UTILIZATION}); the KV cache is sized within it")
    parser.add_argument("--compute", choices=("torch", "triton"), default=None,
                        help="with --model: the MoE compute (default: triton on a GPU where the model's rows fit "
                        "its kernels, else torch)")
    parser.add_argument("--numerics", choices=("standard", "exact"), default=None,
                        help="with --model: `exact` decodes and prefills on the batch-invariant kernels (a row's "
                        "logprobs do not depend on the batch, and equal the trainer's exact forward bitwise); "
                        "default standard")
    parser.add_argument("--port", type=int, default=ROLLOUT_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args(argv)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if args.model:
        logging.basicConfig(level=logging.INFO)
        run = model_served(args, processes, torch.cuda.is_available())
    else:
        for flag in ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "compute", "numerics"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} applies to --model; a run sets rollout.max_batch_size, "
                             "local_gpus.rollout.memory_share, moe_compute and numerics")
        run = load(args.run)
        cap_gpu_memory(run, "rollout")
    torch.set_num_threads(1)
    if processes != run.rollout.gpus_per_server:
        raise SystemExit(f"rollout.gpus_per_server is {run.rollout.gpus_per_server} but this server has {processes} "
                         "process(es); start one per GPU with torchrun (moe_rl_eks.core.launch)")
    # A server on its trainer's GPU takes versions from the trainer's GPU memory (rl/device_weights.py).
    channel = device_channel(run) if processes == 1 else None
    replica = Replica.sharded(run) if processes > 1 else Replica(
        run, importer=DeviceImporter(*channel) if channel is not None else None)
    if replica.rank > 0:  # the HTTP server and the engine live on rank 0; this rank follows its operations
        follow(replica)
        return 0
    store = ModelDirectoryStore(args.model) if args.model else open_store(run.rl.weights, output_dir(run) / "weights")
    # Downloads go to the pod's own scratch space: the run's output directory is read-only for rollout pods.
    cache = Path(tempfile.mkdtemp(prefix="moerl-rollout-cache-"))
    tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
    engine = RolloutEngine(run, store, cache, tokenizer, replica)
    server = RolloutServer(run, engine, tokenizer, token=os.environ.get(run.rl.weight_token_env))
    # Serve /health at once (/ready answers 503 until weights arrive), and pick up the newest published version.
    threading.Thread(target=_load_first_version, args=(server, store), daemon=True).start()
    log.info("rollout server on %s:%d", args.host, args.port)
    try:
        serve(make_app(server), args.host, args.port)
    finally:
        engine.stop()
    return 0


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1 (rows decoded at once)")
    return value


def _positions(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 2 (positions per row: a prompt token and a new one)")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value}: must be in (0, 1], the fraction of each GPU's memory")
    return value


def model_served(args: argparse.Namespace, processes: int, cuda: bool):
    """The run serving `--model`: its compute (triton on a GPU by default), its batch (--max-num-seqs) and, on a GPU,
    this process's memory capped at --gpu-memory-utilization, which the KV cache is then sized within
    (kv_cache_manager.fitting_blocks); refused when that share cannot hold the weights and one full row."""
    import torch

    from ..rl.model_dir import (CPU_MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, kv_cache_positions,
                                model_run, serving_compute)

    # On the CPU the KV cache is allocated whole for every row (nothing sizes it from memory): the smaller batch.
    options = {"max_new_tokens": args.max_new_tokens, "max_model_len": args.max_model_len,
               "gpus_per_server": processes,
               "max_batch_size": args.max_num_seqs or (MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS),
               "numerics": args.numerics or "standard"}
    try:
        run = model_run(args.model, **options)
    except ValueError as exc:  # a length that does not fit the model: named, with what is allowed
        raise SystemExit(f"moerl serve-rollout --model {args.model}: {exc}") from None
    compute, why = (args.compute, "--compute") if args.compute else serving_compute(run.model, cuda)
    run = model_run(args.model, moe_compute=compute, **options)
    log.info("serving %s with moe_compute %s (%s), numerics %s, up to %d rows at once", args.model, compute, why,
             run.numerics, run.rollout.max_batch_size)
    if cuda:
        utilization = args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
        total = torch.cuda.get_device_properties(0).total_memory
        row = run.rl.sampling.max_prompt_tokens + run.rollout.max_new_tokens
        try:
            positions = kv_cache_positions(run.model, gpu_bytes=total, utilization=utilization, max_len=row,
                                           gpus=processes)
        except ValueError as exc:
            raise SystemExit(f"moerl serve-rollout: {exc}") from None
        for device in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(utilization, device)
        log.info("memory: %.2f of the GPU's %.1f GiB; about %d KV-cache positions after the weights (%d rows of %d)",
                 utilization, total / 2**30, positions, positions // row, row)
    return run


def _load_first_version(server: RolloutServer, store) -> None:
    while server.engine.version is None:
        latest = store.latest()  # a VersionRef (lineage, version), or None before the first publication
        if latest is not None:
            try:
                server.load_version(latest.version, latest.lineage)
            except Exception as exc:  # noqa: BLE001 -- pruned meanwhile: try the newer one
                log.warning("loading version %s failed: %s", latest, exc)
        time.sleep(0.2)
