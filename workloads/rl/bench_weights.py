"""`bench-weights` (GPU machine): weight publication and loading for the Qwen3-30B-A3B shape, stage by stage,
against the disk's own sequential bandwidth measured in the same run on the same filesystem.

Stages: snapshot (device -> pinned host, the trainer's critical path; first call includes pinning the buffers),
write + commit (background writer: files, fsync, rename), fetch (manifest and sizes), load (files read in
parallel straight to the GPU with checksums verified, page cache dropped first: a cold read), and the rollout
server's own load (its replica reads the version to host memory, since the GPU holds the served weights and a KV
cache, and copies it into the served model in place; page cache dropped first). The trainer holds
float32 master weights and publishes bf16, as ours does. Layers are scaled down to what the disk holds (three
versions and a baseline file); every figure is also extrapolated linearly in bytes to the 48-layer model.
Run as `python3 -m moe_rl_eks.workloads.rl.bench_weights --dir DIR --out results.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from moe_rl_eks.core.run import ModelConfig, RunConfig
from moe_rl_eks.core.schema import parse

from ..model import MoETransformer
from ..model.checkpoint import load_hf, published_dtype
from .model_dir import model_run_data
from .publisher import Publisher
from .replica import Replica
from .weights import DirectoryStore

QWEN3_30B_A3B = ModelConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                            num_experts_per_tok=8, max_position_embeddings=40960, dtype="bfloat16")
CHUNK = 64 << 20


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in MoETransformer(config).state_dict().items()}


def published_bytes(config: ModelConfig) -> int:
    total = 0
    for name, shape in shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        n = 1
        for s in shape:
            n *= s
        total += n * torch.empty((), dtype=published_dtype(name, torch.float32, torch.bfloat16)).element_size()
    return total


def disk_bandwidth(directory: Path, nbytes: float) -> tuple[float, float]:
    """Sequential write (64 MiB writes, then fsync) and cold read (page cache dropped) of one file, GB/s."""
    path = directory / "baseline.bin"
    buffer = memoryview(torch.randint(0, 255, (CHUNK,), dtype=torch.uint8).numpy())
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    chunks = max(1, int(-(-nbytes // CHUNK)))
    for _ in range(chunks):
        view = buffer
        while view:
            view = view[os.write(fd, view):]
    os.fsync(fd)
    os.close(fd)
    write = chunks * CHUNK / (time.perf_counter() - start) / 1e9
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    target = bytearray(CHUNK)
    start, done = time.perf_counter(), 0
    while n := os.readv(fd, [target]):
        done += n
    read = done / (time.perf_counter() - start) / 1e9
    os.close(fd)
    path.unlink()
    return write, read


def drop_page_cache(directory: Path) -> None:
    """Forget the cached pages of a version's files, so the next read of them comes from the disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def serving_replica(directory: Path, device: torch.device) -> Replica:
    """A one-GPU rollout server's replica of the checkpoint in `directory`, serving it (the first load builds the
    model). The built-in tokenizer: this benchmark serves no text."""
    data = model_run_data(directory)
    data["rl"]["sampling"]["tokenizer"] = "builtin"
    replica = Replica(parse(RunConfig, data, source=f"bench-weights {directory}"), device=device)
    replica.begin_read(0, str(directory)).result()
    replica.swap(0)
    return replica


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fake_step(a: torch.Tensor, b: torch.Tensor, matmuls: int) -> float:
    """A stand-in for a training step's GPU work (its length is what matters here)."""
    sync(a.device)
    start = time.perf_counter()
    for _ in range(matmuls):
        a @ b
    sync(a.device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-weights", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="the store's filesystem (the disk measured)")
    parser.add_argument("--layers", type=int, default=12, help="at most this many layers (fewer if the disk is small)")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed with and without publication")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--baseline-gb", type=int, default=8, help="size of the disk baseline's file")
    parser.add_argument("--budget-s", type=float, default=120,
                        help="fewer layers if the disk would need longer than this for the writes and reads")
    parser.add_argument("--device", default="cuda", help="cpu only to try the script out")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.dir.mkdir(parents=True, exist_ok=True)
    full = published_bytes(QWEN3_30B_A3B)
    write_bw, read_bw = disk_bandwidth(args.dir, args.baseline_gb * 10**9)
    print(f"disk at {args.dir}: sequential write {write_bw:.2f} GB/s (64 MiB writes, fsync), read {read_bw:.2f} "
          f"GB/s (page cache dropped), {args.baseline_gb} GB file", flush=True)
    free = shutil.disk_usage(args.dir).free

    def fits(layers: int) -> bool:  # three versions on disk; about four written and one read in the budget
        gb = published_bytes(dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)) / 1e9
        return 3.5 * gb * 1e9 < free and gb * (4 / write_bw + 1 / read_bw) < args.budget_s

    layers = args.layers
    while layers > 1 and not fits(layers):
        layers -= 1
    config = dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)
    nbytes = published_bytes(config)
    scale = full / nbytes
    print(f"Qwen3-30B-A3B shape, {layers} of 48 layers: {nbytes / 1e9:.2f} GB published (bf16; the 48-layer "
          f"model {full / 1e9:.2f} GB, x{scale:.2f}); disk free {free / 1e9:.0f} GB", flush=True)

    torch.manual_seed(0)
    state = {k: torch.randn(s, device=device) * 0.02 for k, s in shapes(config).items()}  # float32 masters
    store = DirectoryStore(args.dir / "store", keep_versions=2)
    publisher = Publisher(store, config, lineage=0)

    publisher.publish(0, state)
    snapshot_first = publisher.snapshot_seconds
    print(f"snapshot (first, pins the buffers): {snapshot_first:.2f} s", flush=True)
    start = time.perf_counter()
    publisher.flush()
    write = time.perf_counter() - start
    print(f"write + fsync + commit: {write:.2f} s", flush=True)
    if publisher.published != 0:
        raise SystemExit("version 0 was not published (the log says why)")
    start = time.perf_counter()
    directory = store.fetch(store.latest(), args.dir / "cache")
    fetch = time.perf_counter() - start
    start = time.perf_counter()
    _, loaded = load_hf(directory, device=device, drop_cache=True)
    sync(device)
    load = time.perf_counter() - start
    print(f"fetch {fetch:.3f} s, load to {device} (cold) {load:.2f} s", flush=True)
    mismatched = [k for k, v in state.items() if not torch.equal(loaded[k], v.to(loaded[k].dtype))]
    del loaded

    publisher.publish(1, state)
    snapshot_steady = publisher.snapshot_seconds
    print(f"snapshot (steady): {snapshot_steady:.2f} s", flush=True)
    publisher.flush()

    side = 8192 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    b = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    fake_step(a, b, 10)
    matmuls = max(10, int(1.0 / fake_step(a, b, 100) * 100))  # a ~1 s step
    without = [fake_step(a, b, matmuls) for _ in range(args.steps)]
    with_publish, snapshots = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        fake_step(a, b, matmuls)
        publisher.publish(2 + i, state)
        with_publish.append(time.perf_counter() - start)
        snapshots.append(publisher.snapshot_seconds)
    publisher.close()

    served = store.latest()
    directory = store.fetch(served, args.dir / "cache")
    replica = serving_replica(directory, device)
    drop_page_cache(directory)
    start = time.perf_counter()
    replica.begin_read(1, str(directory)).result()
    read_host = time.perf_counter() - start
    replica.swap(1)
    sync(device)
    serving_load = time.perf_counter() - start
    print(f"rollout server load of version {served.version} (cold): host read {read_host:.2f} s, with the in-place "
          f"copy to {device} {serving_load:.2f} s", flush=True)
    held = replica.model.state_dict()
    mismatched += [f"served {k}" for k, v in state.items()
                   if k not in held or not torch.equal(held[k], v.to(held[k].dtype))]
    del replica

    end_to_end = snapshot_steady + write + fetch + load
    serving_end_to_end = snapshot_steady + write + fetch + serving_load
    floor = nbytes / 1e9 / write_bw + nbytes / 1e9 / read_bw
    gb = nbytes / 1e9
    rows = [("snapshot, first (pins buffers)", snapshot_first), ("snapshot (critical path)", snapshot_steady),
            ("write + fsync + commit (background)", write), ("fetch (manifest, sizes)", fetch),
            ("load to GPU, cold, checksums verified", load),
            ("end to end (snapshot + write + fetch + load)", end_to_end),
            ("rollout server load, cold (host read + in-place copy)", serving_load),
            ("end to end to a serving replica (snapshot + write + fetch + server load)", serving_end_to_end),
            ("disk floor: bytes/write_bw + bytes/read_bw", floor)]
    print(f"\n| stage | seconds ({layers} layers, {gb:.2f} GB) | GB/s | seconds for 48 layers ({full / 1e9:.1f} GB, "
          "linear) |\n|---|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {gb / seconds:.2f} | {seconds * scale:.1f} |")
    print(f"\nend to end = {floor / end_to_end:.0%} of the disk's sequential bandwidth (target >= 70 %); "
          f"to a serving replica {floor / serving_end_to_end:.0%}")
    print(f"training step ({matmuls} bf16 {side}^3 matmuls): {statistics.mean(without):.3f} s without publication, "
          f"{statistics.mean(with_publish):.3f} s with (snapshots {', '.join(f'{s:.2f}' for s in snapshots)} s); "
          f"published {publisher.published}, superseded {publisher.superseded}")
    print(f"all {len(state)} tensors loaded equal to the bf16 cast of the trainer's: {not mismatched}")
    results = {
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layers": layers, "bytes": nbytes, "bytes_48_layers": full,
        "disk": {"write_gb_s": write_bw, "read_gb_s": read_bw, "path": str(args.dir)},
        "seconds": {"snapshot_first": snapshot_first, "snapshot": snapshot_steady, "write_commit": write,
                    "fetch": fetch, "load_cold": load, "end_to_end": end_to_end, "disk_floor": floor,
                    "serving_read_host": read_host, "serving_load_cold": serving_load,
                    "serving_end_to_end": serving_end_to_end},
        "efficiency": floor / end_to_end, "serving_efficiency": floor / serving_end_to_end,
        "critical_path_48_layers_s": snapshot_steady * scale,
        "step_s": {"without_publication": without, "with_publication": with_publish, "snapshots": snapshots},
        "published": publisher.published, "superseded": publisher.superseded, "mismatched": mismatched,
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(args.dir / "store", ignore_errors=True)
    return 0 if not mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
