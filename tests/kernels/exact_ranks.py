"""The exact numerics mode's expert-parallel ranks: gloo processes, each holding its slice of the experts, on the CPU
running the exact kernels under Triton's interpreter (inherited through the environment) with the test process's
row-invariant tl.dot, or compiled, every rank sharing cuda:0 (gloo moves the all-to-all's CUDA tensors; NCCL takes
one GPU per rank). Imported by the tests by module name, so worker processes can unpickle these functions."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import row_invariant_dot
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl_eks.core.run import ModelConfig, RunConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.transformer import expert_slice
from moe_rl_eks.workloads.moe.parallel import ExpertParallel, local_experts
from moe_rl_eks.workloads.rollout.engine_api import RowRequest
from moe_rl_eks.workloads.rollout.replica import Replica, StepPlan, follow
from moe_rl_eks.workloads.rl.protocol import Batch
from moe_rl_eks.workloads.trainer.loop import Trainer
from moe_rl_eks.workloads.trainer.microbatch import Sequences, sequence_tokens
from moe_rl_eks.workloads.trainer.numerics import ExactScorer


def run_ep_ranks(world: int, fn, *args) -> list:
    """fn(rank, world, *args) on `world` gloo processes; every rank's result (CUDA tensors come back on cuda:0)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, tmp, fn, args), nprocs=world, start_method="forkserver")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _rank(rank: int, world: int, tmp: str, fn, args) -> None:
    torch.set_num_threads(1)
    row_invariant_dot.install()  # the test process's tl.dot under the interpreter (conftest.py), in this one too
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def exact_scores(rank: int, world: int, config: ModelConfig, state: dict[str, torch.Tensor],
                 microbatches: list[list[list]], temperature: float, device: str) -> list[torch.Tensor]:
    """The trainer's exact scorer on this EP rank (its experts of `state`, loaded as Trainer.publish hands it a
    version) over this rank's micro-batches `microbatches[rank]` (lists of samples; every rank runs as many, an
    empty one where it has nothing) on `device`: each one's logprobs [B, S]."""
    ep = ExpertParallel(dist.group.WORLD, "alltoall")
    with torch.device("meta"):  # the trainer's policy, laid out over the EP ranks (its weights are not read)
        policy = MoETransformer(config, ep=ep)
    scorer = ExactScorer(policy, torch.device(device))
    scorer.load(expert_slice(state, local_experts(ep, config.num_experts)))
    return [scorer.logprobs(Sequences.of(samples).to(device), temperature)[0] for samples in microbatches[rank]]


def exact_server(rank: int, world: int, run: RunConfig, checkpoint: str, shares: list[list[RowRequest]],
                 slots: int, max_len: int, device: str) -> dict[int, tuple[list[int], list[float]]] | None:
    """A rollout server sharded over the ranks (each its Replica, rank 0 driving, the others following) serving
    the version in `checkpoint`: rank r decodes the rows `shares[r]`, `slots` at a time, every rank stepping until
    all of them have finished. Rank 0 returns each row's (tokens, logprobs) by its `row`; the others None."""
    ep = ExpertParallel.for_serving(dist.group.WORLD, run.model, device=device, rows_per_rank=slots,
                                    exact=run.numerics == "exact")
    replica = Replica(run, ep=ep, control=dist.new_group(backend="gloo"), device=torch.device(device))
    if rank > 0:
        follow(replica)
        return None
    replica.begin_read(0, checkpoint)
    replica.swap(0)
    plan, done = StepPlan(shares, [[] for _ in shares], slots, max_len, ()), {}
    while len(done) < sum(map(len, shares)):
        done.update((out.row, (out.token_ids, out.logprobs)) for report in replica.step(plan)
                    for out in report.finished)
        plan = dataclasses.replace(plan, admit=[[] for _ in shares])
    replica.stop()
    return done


def exact_trainer(rank: int, world: int, run: RunConfig, batch_json: dict) -> dict:
    """A trainer rank of `run` (numerics: exact) publishing version 0, as it does before its first batch (which
    loads its exact scorer), then scoring its share of the batch with it and taking one RL step on the batch: the
    scorer's logprobs of each of its samples by id, and the step's metrics."""
    trainer = Trainer(run, None, rank, world)
    trainer.start_publishing()
    trainer.publish(0)
    batch = Batch.from_json(batch_json)
    share = trainer._share(batch.samples)
    scored, _ = trainer.train_step.score(Sequences.of(share), temperature=run.rl.sampling.temperature, replay=False)
    metrics = trainer.rl_step(batch)
    trainer.stop_publishing()
    return {"logprobs": {s.id: scored[i, :sequence_tokens(s)] for i, s in enumerate(share)}, "metrics": metrics}
