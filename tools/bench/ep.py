"""`moerl bench-ep`: dispatch + combine throughput of each available EP backend, after DeepEP's own method
(tests/test_intranode.py): 4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16 rows; bandwidth is the
bytes a rank receives in dispatch (and sends back in combine) over the time of that call; warm-up runs, then
the median of timed runs. Ranks are processes of one group: NCCL one rank per GPU when there are enough GPUs,
else gloo (CPU, or every rank on cuda:0, where ranks time-share the GPU and timings mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl_eks.workloads.moe.dispatch import LocalDispatcher
from moe_rl_eks.workloads.moe.parallel import ExpertParallel
from moe_rl_eks.workloads.moe.torch_compute import TorchCompute


def _routing(args, rank: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    # As DeepEP's test: |N(0,1)| + 1 scores, top-k of them.
    scores = torch.randn(args.tokens, args.experts, generator=gen).abs() + 1
    weights, ids = scores.topk(args.top_k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(dispatcher, args, rank, device, group) -> dict:
    """Median dispatch and combine times; bytes = rows received in dispatch x hidden x 2 (bf16), also what
    combine sends back (DeepEP's dispatch recv / combine send bytes). For `local` (no network) they are
    the permuted rows, as a memory-traffic baseline."""
    x, weights, ids = _routing(args, rank, device)
    dispatch_s, combine_s, rows = [], [], 0
    for rep in range(args.warmup + args.reps):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        x_sorted, _, handle = dispatcher.dispatch(x, weights, ids)
        _sync(device)
        mid = time.perf_counter()
        dispatcher.combine(x_sorted, handle)
        _sync(device)
        end = time.perf_counter()
        if rep >= args.warmup:
            dispatch_s.append(mid - start)
            combine_s.append(end - mid)
        rows = dispatcher.received_rows(handle)
    return dict(dispatch_s=statistics.median(dispatch_s), combine_s=statistics.median(combine_s),
                bytes=rows * args.hidden * 2)


def _worker(rank: int, world: int, args, init_file: str, out_file: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    use_cuda = args.device == "cuda"
    one_per_gpu = use_cuda and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if one_per_gpu else 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    transport = "nccl" if one_per_gpu else "gloo"
    dist.init_process_group(transport, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            **({"device_id": device} if transport == "nccl" else {}))
    rows = []
    for backend in args.backends:
        if backend == "local":
            continue
        try:
            ep = ExpertParallel(dist.group.WORLD, backend, device=device.type)
            dispatcher = ep.dispatcher(TorchCompute(), args.experts, args.hidden)
        except Exception as exc:  # report why a backend cannot run here, keep measuring the others
            rows.append(dict(backend=backend, ranks=world, skipped=str(exc)))
            continue
        result = _measure(dispatcher, args, rank, device, dist.group.WORLD)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, result)
        rows.append(dict(backend=backend, ranks=world, transport=transport, device=str(device),
                         shared_gpu=use_cuda and not one_per_gpu, **_summarise(per_rank)))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _summarise(per_rank: list[dict]) -> dict:
    d = statistics.mean(r["dispatch_s"] for r in per_rank)
    c = statistics.mean(r["combine_s"] for r in per_rank)
    b = statistics.mean(r["bytes"] for r in per_rank)
    return dict(dispatch_ms=d * 1e3, combine_ms=c * 1e3, recv_mb=b / 1e6, dispatch_gbs=b / d / 1e9,
                combine_gbs=b / c / 1e9)


def _local(args) -> dict:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    result = _measure(LocalDispatcher(TorchCompute(), args.experts), args, 0, device, None)
    return dict(backend="local", ranks=1, transport="-", device=str(device), shared_gpu=False,
                **_summarise([result]))


def run(args) -> list[dict]:
    rows = [_local(args)] if "local" in args.backends else []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
            mp.start_processes(_worker, args=(world, args, init_file, out_file), nprocs=world, join=True,
                               start_method="spawn")
            with open(out_file) as f:
                rows.extend(json.load(f))
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'backend':9} {'ranks':>5} {'transport':9} {'device':7} {'dispatch ms':>11} {'combine ms':>10} " \
           f"{'recv MB':>8} {'dispatch GB/s':>13} {'combine GB/s':>12}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['backend']:9} {r['ranks']:>5} {'-':9} {'-':7} {'':>11} {'':>10} {'':>8} {'':>13} "
                         f"{'':>12}  not run: {r['skipped']}")
            continue
        note = "ranks share one GPU: timings meaningless" if r["shared_gpu"] else ""
        lines.append(f"{r['backend']:9} {r['ranks']:>5} {r['transport']:9} {r['device'][:7]:7} "
                     f"{r['dispatch_ms']:>11.2f} {r['combine_ms']:>10.2f} {r['recv_mb']:>8.1f} "
                     f"{r['dispatch_gbs']:>13.2f} {r['combine_gbs']:>12.2f}  {note}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl bench-ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="process counts to run (default: 2)")
    p.add_argument("--backends", nargs="+", default=["local", "alltoall", "deepep"],
                   choices=["local", "alltoall", "deepep"])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "top_k", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        p.error(f"--top-k ({args.top_k}) must be <= --experts ({args.experts})")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print(f"bench-ep: {args.tokens} tokens/rank, hidden {args.hidden}, top-{args.top_k} of {args.experts} experts, "
          f"bf16, {args.warmup} warm-up + median of {args.reps}; device {args.device}; torch {torch.__version__}",
          flush=True)
    rows = run(args)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="moerl bench-ep " + " ".join(argv), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
