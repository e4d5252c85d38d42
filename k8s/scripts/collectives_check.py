"""Cluster validation, started by torchrun on every trainer node (the validation chart ships this file in a
ConfigMap; it runs in the trainer image, never imported by k8s/).

Measures NCCL all-reduce and all-to-all bus bandwidth across all ranks (nccl-tests' definitions) and reports
which network NCCL chose on each rank, read from NCCL's own INFO log. Exits 1 when a rank that should use EFA
(FI_PROVIDER=efa) fell back to sockets: NCCL does that silently, at a fraction of the bandwidth.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist

# nccl-tests' bus bandwidth factors: bytes each rank moves over the slowest link per byte of payload.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
# NCCL's INFO lines, most specific first: a plugin that loads and then fails still logs NET/OFI lines before
# NCCL falls back to sockets.
NET_MARKERS = (("Selected provider is efa", "efa"), ("NET/Socket", "socket"), ("NET/IB", "ib"), ("NET/OFI", "ofi"))


def run_op(op: str, buf: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf)
    else:
        dist.all_to_all_single(out, buf)


def measure(op: str, nbytes: int, device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per operation on `nbytes` of float32 per rank (largest multiple of the world size that fits)."""
    world = dist.get_world_size()
    numel = max(world, nbytes // 4 // world * world)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)
    for _ in range(warmup):
        run_op(op, buf, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run_op(op, buf, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(elapsed.item())


def network_in_use(backend: str) -> str:
    """'efa', 'ofi', 'ib', 'socket' from this process's NCCL log; the backend's name when it is not NCCL."""
    if backend != "nccl":
        return backend
    path = os.environ.get("NCCL_DEBUG_FILE", "").replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    try:
        log = open(path, errors="replace").read()
    except OSError:
        return "unknown (set NCCL_DEBUG=INFO and NCCL_DEBUG_FILE)"
    return next((name for marker, name in NET_MARKERS if marker in log), "unknown")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank == 0:
        print(f"{'op':<11} {'bytes':>12} {'time_us':>10} {'algbw_GBps':>11} {'busbw_GBps':>11}   ({world} ranks, {backend})")
    size = args.min_bytes
    while size <= args.max_bytes:
        for op in ("all_reduce", "all_to_all"):
            seconds = measure(op, size, device, args.iters, args.warmup)
            algbw = size / seconds / 1e9
            if rank == 0:
                print(f"{op:<11} {size:>12} {seconds * 1e6:>10.1f} {algbw:>11.2f} {algbw * BUS_FACTOR[op](world):>11.2f}")
        size *= 4
    networks = [None] * world
    dist.all_gather_object(networks, (socket.gethostname(), network_in_use(backend)))
    efa_expected = os.environ.get("FI_PROVIDER") == "efa"
    bad = sorted({host for host, net in networks if efa_expected and net != "efa"})
    if rank == 0:
        print("network per rank:", ", ".join(f"{i}:{host}:{net}" for i, (host, net) in enumerate(networks)))
        print(f"EFA expected: {efa_expected}; " + (f"FAILED on {', '.join(bad)}" if bad else "OK"))
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
