"""`bench-weights` (GPU machine): weight publication and loading for the Qwen3-30B-A3B shape, stage by stage,
against the disk's own sequential bandwidth measured in the same run on the same filesystem.

Stages: snapshot (device -> pinned host, the trainer's critical path; first call includes pinning the buffers),
write + commit (background writer: files, fsync, rename; timed by the writer, without the pinning of its spare
snapshot, which happens once after its first write), fetch (manifest and sizes), load (`load_hf`: files read in
parallel straight to the GPU with checksums verified, page cache dropped first: a cold read), and the rollout
server's own load: its replica, already serving the model, reads the version into its pinned host staging
(checksums verified; the GPU holds the served weights and a KV cache, so not a second GPU copy), page cache
dropped first, then swaps it into the served tensors in place (weight_staging.py). End to end to a serving
replica = snapshot + write + fetch + read + swap, against the floor bytes/write_bw + bytes/read_bw. Beside it, in the
same run, the device path a server on the trainer's GPU takes (workloads/rl/device_weights.py): the trainer's export
(cast into its GPU export), then a server in another process takes it by CUDA IPC handle and swaps it in device to
device, three versions (the first also builds the server's model). The trainer
holds float32 master weights and publishes bf16, as ours does. Layers are scaled down to what the disk holds
(three versions and a baseline file); every figure is also extrapolated linearly in bytes to the 48-layer model.
Run as `python3 -m moe_rl_eks.tools.bench.weights --dir DIR --out results.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import secrets
import shutil
import statistics
import time
from pathlib import Path

import torch

from moe_rl_eks.core.models import known_model
from moe_rl_eks.core.run import ModelConfig, RunConfig
from moe_rl_eks.core.schema import parse

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import load_hf, published_dtype
from moe_rl_eks.workloads.rl.device_weights import DeviceExporter, DeviceImporter, address
from moe_rl_eks.workloads.rl.model_dir import model_run_data
from moe_rl_eks.workloads.rl.protocol import VersionRef
from moe_rl_eks.workloads.trainer.publisher import Publisher
from moe_rl_eks.workloads.rollout.replica import Replica
from moe_rl_eks.workloads.rl.weights import DirectoryStore

QWEN3_30B_A3B = known_model("qwen3-30b-a3b")
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


def serving_run(directory: Path) -> RunConfig:
    """A run serving the checkpoint in `directory`, with the built-in tokenizer: this benchmark serves no text."""
    data = model_run_data(directory)
    data["rl"]["sampling"]["tokenizer"] = "builtin"
    return parse(RunConfig, data, source=f"bench-weights {directory}")


def serving_load(directory: Path, device: torch.device) -> tuple[Replica, float]:
    """A one-GPU rollout server's replica serving the checkpoint in `directory` (its first load builds the model
    and pins the host staging), and that first load's seconds."""
    replica = Replica(serving_run(directory), device=device)
    start = time.perf_counter()
    replica.begin_read(0, str(directory)).result()
    replica.swap(0)
    sync(device)
    return replica, time.perf_counter() - start


def device_server(run: RunConfig, channel: tuple[str, bytes], device: str, commands, replies) -> None:
    """A rollout server on the trainer's GPU, in its own process (a CUDA IPC handle cannot be opened by the
    process that made it): for each version asked, take it from the trainer's export and swap it in, timed; the
    served tensors go back (as IPC handles) for the trainer's side to compare."""
    replica = Replica(run, device=torch.device(device), importer=DeviceImporter(*channel))
    for version, path in iter(commands.get, None):
        start = time.perf_counter()
        via = replica.begin_read(version, path).result().via
        read = time.perf_counter() - start
        start = time.perf_counter()
        replica.swap(version)
        sync(replica.device)
        replies.put((via, read, time.perf_counter() - start, replica.model.state_dict()))
        commands.get()  # compared: the next version may be swapped in
    replica.stop()


def device_swaps(run: RunConfig, config: ModelConfig, state: dict[str, torch.Tensor], directory: Path,
                 device: torch.device, versions: int = 3) -> tuple[list[dict], list[str]]:
    """The device path (rl/device_weights.py) to a server process on the same GPU: per version, the trainer's
    export and the server's take + swap; and the tensors served that differ from the bf16 cast of the trainer's.
    The first version also builds the server's model and opens the export's handles (later ones reuse both)."""
    channel = (address(directory / "device-channel"), secrets.token_hex(16).encode())
    exporter = DeviceExporter(config, *channel)
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    process = context.Process(target=device_server, args=(run, channel, str(device), commands, replies), daemon=True)
    process.start()
    rows, mismatched = [], []
    try:
        for version in range(versions):
            if not exporter.export(VersionRef(0, version), state):
                raise SystemExit(f"the export of version {version} was still held by the server")
            commands.put((version, str(directory)))
            via, read, swap, served = replies.get(timeout=300)
            mismatched += [f"device path {k}" for k, v in state.items()
                           if k not in served or not torch.equal(served[k], v.to(served[k].dtype))]
            del served
            commands.put("compared")
            rows.append({"version": version, "via": via, "export_s": exporter.export_seconds, "take_s": read,
                         "swap_s": swap})
            print(f"device path, version {version}: export {exporter.export_seconds:.3f} s, server take "
                  f"{read:.3f} s (via the {via}), swap {swap:.3f} s", flush=True)
    finally:
        commands.put(None)
        process.join(timeout=60)
        exporter.close(timeout_s=5)
    return rows, mismatched


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
    parser.add_argument("--steps", type=int, default=3,
                        help="training steps timed with and without publication (0: skip that part)")
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

    def fits(layers: int) -> bool:  # three versions on disk; about four written and three read in the budget
        gb = published_bytes(dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)) / 1e9
        return 3.5 * gb * 1e9 < free and gb * (4 / write_bw + 3 / read_bw) < args.budget_s

    layers = args.layers
    while layers > 1 and not fits(layers):
        layers -= 1
    config = dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)
    nbytes = published_bytes(config)
    scale = full / nbytes
    gb = nbytes / 1e9
    print(f"Qwen3-30B-A3B shape, {layers} of 48 layers: {gb:.2f} GB published (bf16; the 48-layer "
          f"model {full / 1e9:.2f} GB, x{scale:.2f}); disk free {free / 1e9:.0f} GB", flush=True)

    torch.manual_seed(0)
    state = {k: torch.randn(s, device=device) * 0.02 for k, s in shapes(config).items()}  # float32 masters
    store = DirectoryStore(args.dir / "store", keep_versions=2)
    publisher = Publisher(store, config, lineage=0)

    publisher.publish(0, state)
    snapshot_first = publisher.snapshot_seconds
    publisher.flush()  # also pins the spare snapshot (once per trainer), which write_seconds leaves out
    write_first = publisher.write_seconds
    print(f"snapshot (first, pins the buffers): {snapshot_first:.2f} s; write + fsync + commit {write_first:.2f} s",
          flush=True)
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
    snapshot = publisher.snapshot_seconds
    publisher.flush()
    write = publisher.write_seconds
    print(f"snapshot (steady): {snapshot:.2f} s; write + fsync + commit {write:.2f} s", flush=True)

    # The rollout server's own load: a replica already serving the model (its first load built it and pinned
    # the staging) reads the version cold into its host staging, checksums verified, then swaps it in place.
    directory = store.fetch(store.latest(), args.dir / "cache")
    replica, first_serving = serving_load(directory, device)
    drop_page_cache(directory)
    start = time.perf_counter()
    replica.begin_read(1, str(directory)).result()
    read_host = time.perf_counter() - start
    start = time.perf_counter()
    replica.swap(1)
    sync(device)
    swap = time.perf_counter() - start
    serving = read_host + swap
    pinned = all(b.is_pinned() for b in replica.staging.buffers.values())
    print(f"rollout server load (cold): read into host staging {read_host:.2f} s (pinned: {pinned}), swap into "
          f"the served model on {device} {swap:.2f} s; its first load (builds the model, pins) {first_serving:.2f} s",
          flush=True)
    held = replica.model.state_dict()
    mismatched += [f"served {k}" for k, v in state.items()
                   if k not in held or not torch.equal(held[k], v.to(held[k].dtype))]
    del held
    replica.stop()
    del replica

    # The same version to a server on the trainer's GPU through device memory, beside the store path above.
    device_rows, device_mismatched = device_swaps(serving_run(directory), config, state, directory, device)
    mismatched += device_mismatched
    steady = device_rows[1:]
    device_export = statistics.median(r["export_s"] for r in steady)
    device_take = statistics.median(r["take_s"] for r in steady)
    device_swap = statistics.median(r["swap_s"] for r in steady)
    device_load = device_take + device_swap
    device_end_to_end = snapshot + device_export + write + device_load

    end_to_end = snapshot + write + fetch + load
    serving_end_to_end = snapshot + write + fetch + serving
    floor = gb / write_bw + gb / read_bw
    rows = [("snapshot, first (pins buffers)", snapshot_first), ("snapshot (critical path)", snapshot),
            ("write + fsync + commit (background; first version)", write_first),
            ("write + fsync + commit (background)", write), ("fetch (manifest, sizes)", fetch),
            ("load_hf to GPU, cold, checksums verified", load),
            ("end to end through load_hf (snapshot + write + fetch + load)", end_to_end),
            ("server first load (builds the model, pins the staging)", first_serving),
            ("server read, cold: disk -> pinned host staging, checksums verified", read_host),
            ("server swap: pinned staging -> served tensors, in place", swap),
            ("server load (read + swap)", serving),
            ("**end to end to a serving replica** (snapshot + write + fetch + read + swap)", serving_end_to_end),
            ("disk floor: bytes/write_bw + bytes/read_bw", floor),
            ("device path: trainer export (cast into its GPU export; critical path)", device_export),
            ("device path: server take (IPC handles, opened once)", device_take),
            ("device path: server swap, device to device, in place", device_swap),
            ("**device path: server load (take + swap)**, vs the store's read + swap above", device_load),
            ("**end to end to the colocated server** (snapshot + export + write + take + swap: the version is "
             "announced once in the store)", device_end_to_end)]
    print(f"\n| stage | seconds ({layers} layers, {gb:.2f} GB) | GB/s | seconds for 48 layers ({full / 1e9:.1f} GB, "
          "linear) |\n|---|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {gb / seconds:.2f} | {seconds * scale:.2f} |")
    print(f"\nend to end to a serving replica = {floor / serving_end_to_end:.0%} of the disk's sequential bandwidth "
          f"(target >= 70 %); through load_hf to the GPU {floor / end_to_end:.0%}", flush=True)
    print(f"server load through device memory {device_load:.3f} s against {serving:.2f} s through the store "
          f"(x{serving / device_load:.0f}); the store is written either way (the announcement waits for it)",
          flush=True)
    print(f"all {len(state)} tensors loaded (load_hf, the served model by the store and by device memory) equal to "
          f"the bf16 cast of the trainer's: {not mismatched}", flush=True)
    results = {
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layers": layers,
        "bytes": nbytes, "bytes_48_layers": full,
        "disk": {"write_gb_s": write_bw, "read_gb_s": read_bw, "path": str(args.dir)},
        "seconds": {"snapshot_first": snapshot_first, "snapshot": snapshot, "write_commit_first": write_first,
                    "write_commit": write, "fetch": fetch, "load_cold": load, "end_to_end": end_to_end,
                    "disk_floor": floor, "serving_first_load": first_serving, "serving_read_host": read_host,
                    "serving_swap": swap, "serving_load_cold": serving, "serving_end_to_end": serving_end_to_end,
                    "device_export": device_export, "device_take": device_take, "device_swap": device_swap,
                    "device_load": device_load, "device_end_to_end": device_end_to_end},
        "device_path": device_rows,
        "efficiency": floor / end_to_end, "serving_efficiency": floor / serving_end_to_end,
        "serving_staging_pinned": pinned, "critical_path_48_layers_s": snapshot * scale, "mismatched": mismatched,
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    save()  # the step comparison below is a separate figure: keep these even if it is cut short
    if args.steps > 0:
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
        print(f"training step ({matmuls} bf16 {side}^3 matmuls): {statistics.mean(without):.3f} s without "
              f"publication, {statistics.mean(with_publish):.3f} s with (snapshots "
              f"{', '.join(f'{s:.2f}' for s in snapshots)} s)", flush=True)
        results["step_s"] = {"without_publication": without, "with_publication": with_publish,
                             "snapshots": snapshots}
    publisher.close()
    print(f"published {publisher.published}, superseded {publisher.superseded}", flush=True)
    results.update(published=publisher.published, superseded=publisher.superseded)
    save()
    shutil.rmtree(args.dir / "store", ignore_errors=True)
    return 0 if not mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
