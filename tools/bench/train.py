"""Trainer micro-batch throughput and memory (`moerl bench-train`, `make bench-train`; on a GPU machine without the
CPU bootstrap: `python3 -m moe_rl_eks.tools.bench.train`).

One training step as the trainer runs it on one GPU (trainer/step.TrainStep): a packed micro-batch (sequences
back to back, each attending only within itself), the model forward to the final hidden states under bf16 autocast
over float32 master weights, the chunked token log-probabilities and entropies (model/logprobs.py), GRPO's
token-mean loss with an entropy term, backward, gradient clipping and a fused AdamW step. For each MoE compute backend, activation
checkpointing on and off, and each sequence length: tokens/s (median step), MFU and peak memory above the
weights and optimizer state (what the step adds: activations, logit chunks, gradients and their transient
buffers). An out-of-memory step is a row, not a failure. `--microbatches N` runs each step over N copies of the
micro-batch, gradients accumulated: from the second on every gradient is held beside a micro-batch's activations,
the peak the planner counts (a step of one micro-batch frees activations as its gradients arrive, and peaks lower).

Model FLOPs per token: 6 x the matmul parameters a token passes through (attention projections, router, its
top-k experts, lm_head; not the embedding lookup) plus causal attention, 6 x n x head_dim x heads per layer for
a token of an n-token sequence (QK^T and PV, fwd + bwd, half the square); recomputation is not counted. MFU is
against the dense bf16 matmul rate measured in the same run (8192^3).

`--exact` adds the exact numerics mode's column from the same run: each row's step again as a batch's first
optimizer step runs it under `numerics: exact` (trainer/numerics.py): the ExactScorer's differentiable forward (a
served-dtype copy of the policy on the batch-invariant kernels, its log-probabilities chunked) for the values and
the gradient, its backward the standard formulas' (model/exact_autograd.py; under FSDP or context parallelism the
exact forward for the values, then the fast forward and backward for the gradient). Under --checkpointing full or
save_attention each exact layer keeps its input and its backward recomputes the policy's layer (the standard step
with its first forward on the exact kernels). Its MFU counts the same model FLOPs; the scorer's weights are reported
apart (`exact_scorer_gib`), not in the weights + AdamW state. Under --ranks the scorer holds each rank's experts and
dispatches over the all-to-all, as the trainer's does (a run refuses exact mode with DeepEP); with --tiny, under
TRITON_INTERPRET=1 (the interpreter runs the exact kernels on the CPU). A batch that takes several optimizer steps
instead pays the exact scorer's forward in place of the standard scoring's fast one, once (its first step takes the
scoring's logprobs): the column's last cell, each scoring's median seconds.

`--ranks N` runs the step under expert parallelism as the trainer does on one node: N processes over NCCL, one
per GPU (gloo on the CPU with --tiny), each holding E / N experts and training its own micro-batch of the given
shape. A row is then the slowest rank's median step time, the tokens of all ranks, MFU against N times the dense
rate, and each rank's peak memory. `--ep-share N` instead trains on one GPU what one rank of an N-rank EP trainer
computes: E / N local experts, each token routed to top-k of them (the expert rows uniform routing sends a rank:
its tokens x k), no all-to-all; `--model qwen3-235b-a22b --ep-share 8` is one EP8 rank of Qwen3-235B-A22B. Each
row also prints what the planner (core/planner.py, `moerl plan`) predicts for that rank: the weights + AdamW
state and the peak above them (gradients and activations). `--publish DIR` then publishes the trained weights once through the trainer's
Publisher (trainer/publisher.py: each rank writes its experts, rank 0 commits the version) into a directory store at
DIR and reports the snapshot and commit times. An out-of-memory step on one rank leaves the others waiting in a
collective: under --ranks an OOM ends the run rather than making a row."""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl_eks.core import memory, planner
from moe_rl_eks.core.models import KNOWN_MODELS, known_model
from moe_rl_eks.core.rl_config import AlgorithmConfig
from moe_rl_eks.core.run import ModelConfig

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers
from moe_rl_eks.workloads.moe.parallel import ExpertParallel
from moe_rl_eks.workloads.rl.algorithms import Algorithm
from moe_rl_eks.workloads.rl.losses import PolicyBatch, Totals
from moe_rl_eks.workloads.trainer.microbatch import Sequences
from moe_rl_eks.workloads.trainer.numerics import ExactScorer
from moe_rl_eks.workloads.rl.protocol import TrainingSample, VersionRef, one_version
from moe_rl_eks.workloads.trainer.step import TrainStep

TINY = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, dtype="float32")


def model_flops_per_step(c: ModelConfig, sequence: int, sequences: int) -> float:
    """Model FLOPs of a step (the planner's count, recomputation not counted, as MFU is quoted)."""
    return planner.training_flops_per_token(c, sequence, "off") * sequence * sequences


def dense_peak_tflops(device: torch.device) -> float:
    """bf16 8192^3 on a GPU (float32 1024^3 on the CPU), median of 10 after 3 warm-ups."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def flash_attention_with_gqa(config: ModelConfig) -> bool:
    """Whether SDPA's flash kernel takes this model's grouped-query attention as it is (else SDPA falls back to
    slower kernels and the attention rows mean less)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, config.num_attention_heads, 256, config.head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, config.num_key_value_heads, 256, config.head_dim, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except RuntimeError:
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """One model + fused AdamW, trained by the trainer's own step (trainer/step.TrainStep) with GRPO's loss and
    an entropy term; `run(batch)` is one optimizer step on a packed micro-batch. With `exact`, the step also holds
    the exact numerics mode's scorer (loaded once, as a published version is: the benchmark's weights hardly move
    at lr 1e-6, and the time does not depend on them) and `run(batch, exact=True)` is a batch's first step."""

    def __init__(self, config: ModelConfig, compute: str, device: torch.device, ep: ExpertParallel | None = None,
                 exact: bool = False):
        self.config, self.device, self.ep = config, device, ep
        with device:
            self.model = MoETransformer(config, compute=compute, ep=ep)
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=cuda)
        world, rank = (ep.size, ep.rank) if ep is not None else (1, 0)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        scorer = ExactScorer(self.model, device) if exact else None
        if scorer is not None:
            scorer.load(self.model.state_dict())
        self.scorer_bytes = (torch.cuda.memory_allocated(device) if cuda else 0) - before
        self.train_step = TrainStep(self.model, None, self.optimizer, ep=ep, world=world, rank=rank, device=device,
                                    grad_clip=1.0, bf16=cuda, exact=scorer)
        self.algorithm = Algorithm(AlgorithmConfig(entropy_coef=1e-3), max_tokens=1)

    def batch(self, sequence: int, sequences: int, generator: torch.Generator) -> Sequences:
        """Random sequences of `sequence` tokens: a 64-token prompt, the rest completion, advantages of both signs."""
        ids = torch.randint(0, self.config.vocab_size, (sequences, sequence + 1), generator=generator).tolist()
        prompt = min(64, sequence // 2)
        samples = [TrainingSample(f"s{i}", seq[:prompt], seq[prompt:], [-1.0] * (len(seq) - prompt), 0.0,
                                  1.0 if i % 2 else -1.0, True, one_version(VersionRef(0, 0), len(seq) - prompt))
                   for i, seq in enumerate(ids)]
        return Sequences.of(samples).to(self.device)

    def run(self, batch: Sequences, exact: bool = False, microbatches: int = 1) -> None:
        """One optimizer step over `microbatches` copies of `batch`, gradients accumulated as the trainer does."""
        local = Totals.local(batch.mask) * microbatches
        if self.ep is not None:  # the loss is normalised over every rank's tokens, as the trainer does
            dist.all_reduce(local, group=self.ep.group)
        totals = Totals.of(local)

        def loss_fn(j, mb, fwd):
            pb = PolicyBatch(fwd.logprobs, fwd.logprobs.detach(), mb.behaviour, mb.advantages[:, None] * mb.mask,
                             mb.mask, entropy=fwd.entropy)
            return self.algorithm.loss(pb, totals)

        self.train_step.step([batch] * microbatches, loss_fn, lr=1e-6, temperature=1.0, replay=False,
                             exact_values=exact)

    @torch.no_grad()
    def score(self, batch: Sequences, exact: bool) -> None:
        """A batch's scoring before its first update, as the trainer runs it when the batch takes several
        optimizer steps: the exact scorer's forward alone (TrainStep.score), or the standard mode's fast forward."""
        if exact:
            self.train_step.score(batch, temperature=1.0, replay=False)
        else:
            self.train_step.forward(self.model, batch, temperature=1.0, replay=False)

    def free(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def planned(config: ModelConfig, checkpointing: str, tokens: int) -> dict:
    """The planner's numbers for this one-GPU model (every parameter on this rank, dense weights replicated): the
    peak counts every gradient beside a whole micro-batch's activations, which the trainer holds from its second
    micro-batch of a step on (a step of one micro-batch frees the activations as the gradients arrive)."""
    experts = config.routed_expert_parameter_count()
    state = memory.trainer_state(replicated=config.parameter_count() - experts, experts=experts, ranks=1, fsdp=False)
    activations = planner.activation_bytes(config, config.num_hidden_layers, tokens, checkpointing)
    return {"planned_weights_and_optimizer_gib": (state.parameter_bytes + state.optimizer_bytes) / 2**30,
            "planned_peak_above_gib": (state.gradient_bytes + activations) / 2**30}


def measure(step: Step, sequence: int, sequences: int, steps: int, peak: float, exact: bool = False,
            microbatches: int = 1) -> dict:
    """A row's numbers (tokens and FLOPs of every micro-batch of a step); `exact`: of the step as a batch's first
    under numerics: exact."""
    c, device = step.config, step.device
    rank = step.ep.rank if step.ep is not None else 0
    batch = step.batch(sequence, sequences, torch.Generator().manual_seed(rank))
    row: dict = {"sequence": sequence, "sequences": sequences, "microbatches": microbatches,
                 "tokens": sequence * sequences * microbatches}
    try:
        step.run(batch, exact, microbatches)  # warm-up: kernels compiled and autotuned, optimizer state made
        step.free()
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            step.run(batch, exact, microbatches)
            sync(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        flops = model_flops_per_step(c, sequence, sequences) * microbatches
        row.update(status="ok", step_seconds=seconds, tokens_per_second=row["tokens"] / seconds,
                   model_tflop_per_step=flops / 1e12, tflops=flops / seconds / 1e12, mfu=flops / seconds / 1e12 / peak)
        if device.type == "cuda":
            row.update(weights_and_optimizer_gib=(base - step.scorer_bytes) / 2**30,
                       peak_above_gib=(torch.cuda.max_memory_allocated(device) - base) / 2**30)
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    step.free()
    return row


def score_seconds(step: Step, sequence: int, sequences: int, steps: int) -> dict:
    """The median scoring forward of a micro-batch, standard and exact (a batch of several optimizer steps pays
    the exact one in place of the standard one, once)."""
    batch = step.batch(sequence, sequences, torch.Generator().manual_seed(0))
    row = {}
    for name, exact in (("standard_score_seconds", False), ("exact_score_seconds", True)):
        step.score(batch, exact)  # warm-up
        times = []
        for _ in range(steps):
            sync(step.device)
            start = time.perf_counter()
            step.score(batch, exact)
            sync(step.device)
            times.append(time.perf_counter() - start)
        row[name] = statistics.median(times)
    return row


def profile_step(step: Step, sequence: int, sequences: int, title: str, path: str) -> None:
    """One step under torch.profiler, its operators by total GPU time appended to `path`: where the MFU goes."""
    from torch.profiler import ProfilerActivity, profile

    batch = step.batch(sequence, sequences, torch.Generator().manual_seed(0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step.run(batch)
        sync(step.device)
    sort = "self_device_time_total" if step.device.type == "cuda" else "self_cpu_time_total"
    with open(path, "a") as f:
        f.write(f"## {title}\n{prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70)}\n")
    step.free()


def _exact_cells(r: dict) -> str:
    """The exact column's cells of a row: its step, MFU and peak, and its step time over the standard one's."""
    e = r["exact"]
    if e["status"] != "ok":
        return f" {e['status']} | | | | |"
    ratio = f"{e['step_seconds'] / r['step_seconds']:.2f}x" if r["status"] == "ok" else "-"
    mem = f"{e['peak_above_gib']:.1f}" if "peak_above_gib" in e else "-"
    score = (f"{e['standard_score_seconds']:.3f} / {e['exact_score_seconds']:.3f}" if "exact_score_seconds" in e
             else "-")
    return f" {e['step_seconds']:.2f} | {100 * e['mfu']:.1f} % | {mem} | {ratio} | {score} |"


def table(result: dict) -> str:
    exact = any("exact" in r for r in result["rows"])
    lines = [f"{result['machine']}; dense matmul peak measured {result['dense_peak_tflops']:.0f} TFLOP/s; "
             f"{result['layers']} layers; weights + AdamW state {result.get('weights_and_optimizer_gib', 0):.1f} GiB"
             + (f" per rank; {result['ranks']} EP ranks ({result['ep_backend']} over {result['transport']}): a row is "
                f"every rank's tokens at the slowest rank's step, MFU of {result['ranks']} x the dense peak, the "
                f"highest rank's memory" if "ranks" in result else "")
             + (f"; numerics: exact = a batch's first optimizer step with the exact scorer's forward (its served "
                f"copy {result.get('exact_scorer_gib', 0):.1f} GiB), MFU of the same model FLOPs" if exact else ""),
             "| compute | checkpointing | sequences x tokens | tokens/s | step s | TFLOP/s | MFU | peak above weights+optimizer GiB | planned GiB |"
             + (" exact step s | exact MFU | exact peak above GiB | exact / standard | score s standard / exact |"
                if exact else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- | --- | --- |" if exact else "")]
    for r in result["rows"]:
        shape = f"{r['sequences']} x {r['sequence']:,}" + (f" x {r['microbatches']} micro-batches"
                                                             if r.get("microbatches", 1) > 1 else "")
        cells = _exact_cells(r) if exact else ""
        if r["status"] != "ok":
            lines.append(f"| {r['compute']} | {r['checkpointing']} | {shape} | {r['status']} | | | | | |{cells}")
            continue
        mem = f"{r['peak_above_gib']:.1f}" if "peak_above_gib" in r else "-"
        plan = f"{r['planned_peak_above_gib']:.1f}" if "planned_peak_above_gib" in r else "-"
        lines.append(f"| {r['compute']} | {r['checkpointing']} | {shape} | {r['tokens_per_second']:,.0f} | "
                     f"{r['step_seconds']:.2f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f} % | {mem} | {plan} |{cells}")
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8x8192,2x32768' -> [(sequences, tokens per sequence), ...]."""
    shapes = []
    for part in text.split(","):
        try:
            sequences, sequence = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: {part!r} is not SEQUENCESxTOKENS (e.g. 8x8192)") from None
        shapes.append((sequences, sequence))
    return shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moerl bench-train", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(KNOWN_MODELS), help="the layer shape")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the model's shape (Qwen3-30B-A3B's 48 do "
                                                          "not fit one GPU with AdamW)")
    ap.add_argument("--ep-share", type=int, default=1, metavar="N",
                    help="train one rank's share of an N-rank EP trainer on one GPU (E / N local experts)")
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("32x2048,8x8192,2x32768"),
                    help="micro-batches as SEQUENCESxTOKENS, comma-separated")
    ap.add_argument("--compute", default="torch,triton", help="MoE compute backends, comma-separated")
    ap.add_argument("--checkpointing", default="full,save_attention,off",
                    help="activation checkpointing modes to measure, comma-separated (full, save_attention, off)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--microbatches", type=int, default=1, metavar="N",
                    help="micro-batches of each shape per optimizer step, gradients accumulated: from the second on "
                         "every gradient is held beside a micro-batch's activations, as in a trainer's step")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke test of this script)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="expert-parallel ranks: processes over NCCL, one per GPU (gloo on the CPU with --tiny)")
    ap.add_argument("--ep-backend", default="alltoall", choices=["alltoall", "deepep"],
                    help="how tokens reach the experts under --ranks")
    ap.add_argument("--publish", metavar="DIR", help="under --ranks: publish the trained weights once through the "
                                                     "trainer's Publisher into a directory store at DIR")
    ap.add_argument("--exact", action="store_true",
                    help="also each row as a batch's first optimizer step under numerics: exact (the exact column)")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--profile", metavar="FILE",
                    help="after each row, one more step under torch.profiler; its kernels by GPU time go to FILE")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.microbatches < 1:
        ap.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.ep_share < 1 or (args.ep_share > 1 and args.ranks > 1):
        ap.error(f"--ep-share {args.ep_share}: must be >= 1, and 1 with --ranks (it stands in for the other ranks)")
    if args.publish and args.ranks == 1:
        ap.error("--publish measures expert-parallel publication: it needs --ranks >= 2")
    if args.exact and args.ranks > 1 and args.ep_backend == "deepep":
        ap.error("--exact with --ep-backend deepep: a run refuses numerics: exact with DeepEP (its combine adds a "
                 "token's expert outputs in an order of its own); use --ep-backend alltoall")
    if args.exact and args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--exact --tiny runs the exact kernels on the CPU through Triton's interpreter: set "
                 "TRITON_INTERPRET=1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        config, device = TINY, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("bench-train needs a CUDA GPU (or --tiny for a CPU smoke test)", file=sys.stderr)
            return 2
        if torch.cuda.device_count() < args.ranks:
            print(f"bench-train --ranks {args.ranks} needs one GPU per rank; this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
        config, device = replace(known_model(args.model), num_hidden_layers=args.layers), torch.device("cuda")
    if args.ep_share > 1:
        if config.num_experts % args.ep_share or config.num_experts // args.ep_share < config.num_experts_per_tok:
            print(f"bench-train --ep-share {args.ep_share} must divide the model's {config.num_experts} experts into "
                  f"shares of at least top-k ({config.num_experts_per_tok})", file=sys.stderr)
            return 2
        config = replace(config, num_experts=config.num_experts // args.ep_share)
    if config.num_experts % args.ranks:
        print(f"bench-train --ranks {args.ranks} must divide the model's {config.num_experts} experts",
              file=sys.stderr)
        return 2
    if args.ranks == 1:
        result = bench(args, config, device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_rank_main, args=(args.ranks, args, config, tmp, out), nprocs=args.ranks, join=True,
                               start_method="spawn")
            result = json.loads(Path(out).read_text())
    print(table(result))
    return 0


def _rank_main(rank: int, world: int, args: argparse.Namespace, config: ModelConfig, tmp: str, out: str) -> None:
    cuda = not args.tiny
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/init", rank=rank,
                            world_size=world, **({"device_id": device} if cuda else {}))
    try:
        torch.manual_seed(0)  # the replicated weights start equal on every rank, as the trainer's do
        ep = ExpertParallel(dist.group.WORLD, args.ep_backend, device=device.type)
        result = bench(args, config, device, ep)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _across_ranks(row: dict, ep: ExpertParallel) -> dict:
    """One row for all ranks: the slowest rank's step, every rank's tokens and memory."""
    rows: list = [None] * ep.size
    dist.all_gather_object(rows, row, group=ep.group)
    if any(r["status"] != "ok" for r in rows):
        return {**rows[0], "status": "/".join(sorted({r["status"] for r in rows}))}
    seconds = max(r["step_seconds"] for r in rows)
    flops = sum(r["model_tflop_per_step"] for r in rows) * 1e12
    tokens = sum(r["tokens"] for r in rows)
    combined = {**rows[0], "ranks": ep.size, "tokens": tokens, "step_seconds": seconds,
                "tokens_per_second": tokens / seconds, "model_tflop_per_step": flops / 1e12,
                "tflops": flops / seconds / 1e12, "rank_step_seconds": [r["step_seconds"] for r in rows]}
    combined["mfu"] = combined["tflops"] / (ep.size * rows[0]["tflops"] / rows[0]["mfu"])
    if "peak_above_gib" in rows[0]:
        combined.update(rank_peak_above_gib=[r["peak_above_gib"] for r in rows],
                        rank_weights_and_optimizer_gib=[r["weights_and_optimizer_gib"] for r in rows],
                        peak_above_gib=max(r["peak_above_gib"] for r in rows),
                        weights_and_optimizer_gib=max(r["weights_and_optimizer_gib"] for r in rows))
    return combined


def publish_once(step: Step, directory: str) -> dict:
    """The trained weights published as version 1 through the trainer's Publisher (each rank its experts; rank 0
    commits): seconds on the critical path (snapshot to host) and until the version is in the store."""
    from moe_rl_eks.workloads.trainer.publisher import Publisher
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    store = DirectoryStore(Path(directory))
    publisher = Publisher(store, step.config, 0, ep=step.ep)
    dist.barrier(step.ep.group)
    start = time.perf_counter()
    publisher.publish(1, step.model.state_dict())
    snapshot = time.perf_counter() - start
    publisher.close()
    dist.barrier(step.ep.group)  # every part written and rank 0's commit done
    total = time.perf_counter() - start
    latest = store.latest()
    files = [p for p in Path(directory).rglob("*.safetensors")]
    return dict(version=None if latest is None else [latest.lineage, latest.version], snapshot_seconds=snapshot,
                published_seconds=total, files=len(files), bytes=sum(p.stat().st_size for p in files))


def bench(args: argparse.Namespace, config: ModelConfig, device: torch.device,
          ep: ExpertParallel | None = None) -> dict:
    """Every (compute, checkpointing, shape) row; with `ep`, on every rank, rows combined on all of them."""
    lead = ep is None or ep.rank == 0
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    result = {"machine": machine, "torch": torch.__version__, "layers": config.num_hidden_layers,
              "config": config.__dict__, "dense_peak_tflops": dense_peak_tflops(device), "rows": [], "errors": []}
    if ep is not None:
        result.update(ranks=ep.size, ep_backend=ep.backend, transport=dist.get_backend(ep.group))
    if device.type == "cuda":
        result.update(flash_attention_with_gqa=flash_attention_with_gqa(config),
                      gpu_memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    if lead:
        print(f"{machine}; torch {torch.__version__}; dense peak {result['dense_peak_tflops']:.0f} TFLOP/s; "
              f"{ {k: v for k, v in result.items() if k in ('flash_attention_with_gqa', 'gpu_memory_gib', 'ranks')} }",
              flush=True)

    def save():
        if args.json and lead:
            Path(args.json).write_text(json.dumps(result, indent=1))

    step = None
    for compute in args.compute.split(","):
        try:
            step = Step(config, compute, device, ep, exact=args.exact)
            if args.exact:
                result["exact_scorer_gib"] = step.scorer_bytes / 2**30
        except Exception:  # e.g. triton missing: the traceback is the report, the other backends still run
            result["errors"].append(traceback.format_exc())
            print(result["errors"][-1], flush=True)
            continue
        for checkpointing in args.checkpointing.split(","):
            checkpoint_layers(step.model, checkpointing)
            for sequences, sequence in args.shapes:
                row = measure(step, sequence, sequences, args.steps, result["dense_peak_tflops"],
                              microbatches=args.microbatches)
                if args.exact:
                    exact = measure(step, sequence, sequences, args.steps, result["dense_peak_tflops"], exact=True,
                                    microbatches=args.microbatches)
                    if ep is not None:
                        exact = _across_ranks(exact, ep)
                    row["exact"] = {k: v for k, v in exact.items() if k not in (
                        "sequence", "sequences", "microbatches", "tokens", "weights_and_optimizer_gib")}
                    if row["exact"]["status"] == "ok":
                        row["exact"].update(score_seconds(step, sequence, sequences, args.steps))
                if args.profile and lead and row["status"] == "ok" and ep is None:
                    profile_step(step, sequence, sequences, f"{compute} {checkpointing} {sequences}x{sequence}",
                                 args.profile)
                if ep is not None:
                    row = _across_ranks(row, ep)
                row.update(compute=compute, checkpointing=checkpointing, ep_share=args.ep_share)
                if ep is None:
                    row.update(planned(config, checkpointing, sequence * sequences))
                if "weights_and_optimizer_gib" in row:
                    result["weights_and_optimizer_gib"] = row["weights_and_optimizer_gib"]
                result["rows"].append(row)
                if lead:
                    print(json.dumps(row), flush=True)
                save()
        if getattr(args, "publish", None) and ep is not None:
            result.setdefault("publish", {})[compute] = publish_once(step, os.path.join(args.publish, compute))
            if lead:
                print(json.dumps({"publish": result["publish"][compute]}), flush=True)
            save()
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return result


if __name__ == "__main__":
    sys.exit(main())
