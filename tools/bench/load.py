"""`bench-load`: how fast `serve-rollout --model DIR` reads a checkpoint from a cold cache, against `dd iflag=direct`
reading the same files in the same command (the disk's own rate without the page cache).

Three figures, one after the other on the same files: dd (`bs=64M iflag=direct`, one file after another), the
serving replica's read into its host staging (safetensors_io: each file read whole with O_DIRECT, files in
parallel; pinned on a GPU; the page cache dropped first), and on a GPU the server's whole first load (the read,
building the model on the GPU, the copy into it). Target: the replica's read at >= 70 % of dd's rate. Without
`--model`, `--layers` layers of the Qwen3-30B-A3B shape with random weights are written to `--dir` first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model.checkpoint import save_hf
from moe_rl_eks.workloads.rollout.replica import Replica
from moe_rl_eks.workloads.rollout.weight_staging import HostStaging

from ..example_data import write_tokenizer_dir
from .rollout import build_model
from .weights import QWEN3_30B_A3B, drop_page_cache, serving_run, sync

TARGET = 0.7


def random_checkpoint(directory: Path, config: ModelConfig) -> Path:
    """A Hugging Face checkpoint of `config` a server can serve, holding bitwise the random weights bench-server's
    own engine serves at that shape (the same seed and init, drawn on the same device), so a served checkpoint's
    speed compares with bench-server's on the same routing; a small generated tokenizer beside them (the
    benchmarks send token ids). Drawn on the GPU where there is one: a host init of 30 GB takes minutes."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    save_hf(build_model(config, device), config, directory)
    write_tokenizer_dir(directory, ["a served checkpoint of random weights"] * 8)
    return directory


def dd_direct(files: list[Path]) -> float:
    """Seconds `dd if=FILE of=/dev/null bs=64M iflag=direct` takes over `files`, one after another."""
    start = time.perf_counter()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True,
                       capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-load", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: write one)")
    parser.add_argument("--dir", type=Path, default=Path("runs/bench-load"), help="where to write it")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 30B shape written without --model")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint written (to serve it next)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    written = args.model is None
    if written:
        shutil.rmtree(args.dir, ignore_errors=True)
        start = time.perf_counter()
        directory = random_checkpoint(args.dir, dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers))
        os.sync()
        print(f"wrote {args.layers} layers of the Qwen3-30B-A3B shape to {directory} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    else:
        directory = args.model
    files = sorted(directory.glob("*.safetensors"))
    gb = sum(f.stat().st_size for f in files) / 1e9
    dd = dd_direct(files)
    print(f"dd iflag=direct bs=64M, {len(files)} files, {gb:.2f} GB: {dd:.2f} s, {gb / dd:.2f} GB/s", flush=True)

    drop_page_cache(directory)
    staging = HostStaging(pin=cuda)
    start = time.perf_counter()
    staging.read(directory, None)
    first = time.perf_counter() - start  # includes making (and on a GPU pinning) the staging buffers
    drop_page_cache(directory)
    start = time.perf_counter()
    staging.read(directory, None)
    read = time.perf_counter() - start
    staging.close()
    print(f"replica read into host staging, cold: {read:.2f} s, {gb / read:.2f} GB/s = {dd / read:.0%} of dd "
          f"(target >= {TARGET:.0%}); its first read, making{' and pinning' if cuda else ''} the buffers: "
          f"{first:.2f} s", flush=True)
    results = {"machine": torch.cuda.get_device_name() if cuda else "cpu", "directory": str(directory),
               "bytes": int(gb * 1e9), "files": len(files), "seconds": {"dd_direct": dd, "staging_read": read,
                                                                     "staging_first_read": first},
               "staging_fraction_of_dd": dd / read}
    if cuda:
        drop_page_cache(directory)
        device = torch.device("cuda")
        replica = Replica(serving_run(directory), device=device)
        start = time.perf_counter()
        replica.begin_read(0, str(directory)).result()
        replica.swap(0)
        sync(device)
        served = time.perf_counter() - start
        replica.stop()
        print(f"server first load, cold (read, build the model on the GPU, copy in): {served:.2f} s, "
              f"{gb / served:.2f} GB/s = {dd / served:.0%} of dd", flush=True)
        results["seconds"]["server_first_load"] = served
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if written and not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
