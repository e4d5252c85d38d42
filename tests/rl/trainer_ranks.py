"""Trainer ranks in gloo processes, or one per GPU over NCCL (imported by module name, so forked or spawned workers find these functions):
one RL step's gradients, and a loop that one rank is asked to stop."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile

import torch
import torch.distributed as dist

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.rl.checkpoint_dirs import latest as latest_checkpoint
from moe_rl_eks.workloads.rl.protocol import Batch
from moe_rl_eks.workloads.trainer.loop import Trainer, stop_on_sigterm


def _entry(fn, rank, world, init_file, out_dir, args, per_gpu):
    torch.set_num_threads(1)
    if per_gpu:  # as torchrun starts the trainer on an H200 x2: rank r on cuda:r, its group as the trainer makes it
        os.environ["LOCAL_RANK"] = str(rank)
        torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 120, per_gpu: bool = False) -> list:
    """fn(rank, world, *args) on `world` processes of one gloo group (on the CPU, or every rank on cuda:0), or with
    `per_gpu` one rank per GPU over NCCL (the results then on cuda:0, beside the test's one-process reference); every
    rank's result."""
    # Never a fork of the test process: a process that has touched CUDA cannot fork a child that uses it ("Cannot
    # re-initialize CUDA in forked subprocess"), and on the CPU a child forked from a pytest process that ran earlier
    # in-process gloo tests inherited their C++ state and once aborted in glibc ("double free or corruption") inside
    # full_tensor (CI, 2026-12-02). The forkserver forks clean children from one process that has imported only the
    # trainer (torch with it), so a child starts in a second, not the five a fresh import takes here; it is named
    # by package, since Python 3.11's forkserver imports its preloads without the tests' sys.path (a failed preload
    # is silently skipped). Children get the parent's sys.path, so they find this module.
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "forkserver")
    ctx.set_forkserver_preload(["moe_rl_eks.workloads.trainer.loop"])
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, tmp, args, per_gpu)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with {codes}")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False,
                           map_location="cuda:0" if per_gpu else None) for r in range(world)]


def step_gradients(trainer: Trainer, batch: Batch) -> tuple[dict, dict]:
    """(gradients as the optimizer saw them, by parameter name; the step's metrics), one optimizer step."""
    names = {id(p): n for n, p in trainer._trained_state().items()}
    seen: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        for group in trainer.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen[names[id(p)]] = p.grad.detach().clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    metrics = trainer.rl_step(batch)
    trainer.optimizer.step = step
    return seen, metrics


def whole(name: str, tensor: torch.Tensor, trainer: Trainer) -> torch.Tensor:
    """The whole tensor of what this rank holds: an FSDP shard all-gathered, the experts gathered from every rank
    (their slices, or shards of slices, as the checkpoint lays them out); collectives: every rank calls it for the
    same names."""
    from torch.distributed.tensor import DTensor

    from moe_rl_eks.workloads.model.parallelize import expert_tensor

    if trainer.world > 1 and ".mlp.experts." in name:
        return expert_tensor(tensor, trainer.ep, trainer.mesh).full_tensor()
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def ep_step_gradients(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """One RL step on `world` ranks; the gradients (whole tensors), the metrics, this rank's samples, and the
    weights and AdamW moments after the step (whole tensors)."""
    trainer = Trainer(load_run(run_path), None, rank, world)
    grads, metrics = step_gradients(trainer, Batch.from_json(batch_json))
    share = trainer._share(Batch.from_json(batch_json).samples)
    return {"grads": {name: whole(name, grad, trainer) for name, grad in grads.items()}, "metrics": metrics,
            "samples": sorted(s.id for s in share), "state": full_state(trainer)}


def routing_read_by_rank(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """One RL step with routing replay on `world` ranks: the routing keys this rank read from the store, and the
    bytes its routing metric counted."""
    from moe_rl_eks.core import metrics as M

    trainer = Trainer(load_run(run_path), None, rank, world)
    read, store_read = [], trainer.routing_store.read

    def recording_read(ref, *args, **kwargs):
        read.append(ref.key)
        return store_read(ref, *args, **kwargs)

    trainer.routing_store.read = recording_read
    trainer.rl_step(Batch.from_json(batch_json))
    return {"read": sorted(read), "bytes_read": trainer.prometheus[M.ROUTING_BYTES_READ]._value.get()}


def warm_then_reference(trainer: Trainer) -> None:
    """The KL reference from the weights now (as after a warm-up), then the policy's weights scaled by 1.1, so
    the policy the RL step trains differs from its reference alike in every layout (an elementwise change: no
    summation order)."""
    trainer._save_eval_weights("warmup")
    trainer.load_reference()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.1)


def ep_step_gradients_from_reference(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """ep_step_gradients with a KL reference (warm_then_reference), and whether its dense weights are sharded."""
    from moe_rl_eks.workloads.model.parallelize import is_sharded

    trainer = Trainer(load_run(run_path), None, rank, world)
    warm_then_reference(trainer)
    grads, metrics = step_gradients(trainer, Batch.from_json(batch_json))
    return {"grads": {name: whole(name, grad, trainer) for name, grad in grads.items()}, "metrics": metrics,
            "reference_embedding_sharded": is_sharded(trainer.reference.model.embed_tokens.weight)}


class ListSource:
    """Batches made on demand, as an orchestrator would hand them out."""

    def __init__(self, make_batch) -> None:
        self.make_batch, self.versions = make_batch, []

    def next_batch(self, step, committed, stopping):
        return None if stopping() else self.make_batch(step)

    def version_published(self, version, lineage):
        self.versions.append((lineage, version))

    def state(self):
        return {"note": "orchestrator state"}


def loop_stopped_on_rank_1(rank: int, world: int, run_path: str, make_batch, signal_at_step: int) -> dict:
    """The trainer's loop on every rank; SIGTERM reaches rank 1 alone, during step `signal_at_step`."""
    trainer = Trainer(load_run(run_path), ListSource(make_batch) if rank == 0 else None, rank, world)
    stop_on_sigterm(trainer)
    train = trainer.rl_step

    def rl_step(batch):
        metrics = train(batch)
        if rank == 1 and batch.step == signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    trainer.rl_step = rl_step
    return _loop_result(trainer, trainer.run_loop())


def loop_resumed(rank: int, world: int, run_path: str, make_batch) -> dict:
    """The loop started again after a stop: it resumes from the checkpoint in a new lineage."""
    trainer = Trainer(load_run(run_path), ListSource(make_batch) if rank == 0 else None, rank, world)
    return _loop_result(trainer, trainer.run_loop())


def _loop_result(trainer: Trainer, code: int) -> dict:
    latest = latest_checkpoint(trainer.ckpt_root)
    return {"code": code, "step": trainer.step, "stop_requested": trainer.stop_requested, "lineage": trainer.lineage,
            "latest": None if latest is None else latest.name,
            "announced": trainer.source.versions if trainer.source is not None else None,
            "store_latest": trainer.store.latest()}


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments by name, whole tensors (FSDP shards and expert slices gathered from every rank)."""
    names = {id(t): n for n, t in trainer._trained_state().items()}
    state = {n: t.detach().clone() for n, t in trainer._trained_state().items()}
    for p, entries in trainer.optimizer.state.items():
        state.update({f"{names[id(p)]}.{k}": v.clone() for k, v in entries.items() if v.dim()})
    return {name: whole(name, t, trainer) for name, t in state.items()}


def train_and_checkpoint(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """One RL step, then a checkpoint of step 1 written by these ranks; the state it holds."""
    trainer = Trainer(load_run(run_path), None, rank, world)
    trainer.rl_step(Batch.from_json(batch_json))
    trainer.step = 1
    trainer.save_checkpoint()
    trainer.poll_checkpoint(wait=True)
    return full_state(trainer)


def resumed_state(rank: int, world: int, run_path: str) -> dict:
    trainer = Trainer(load_run(run_path), None, rank, world)
    assert trainer.try_resume() and trainer.step == 1
    return full_state(trainer)


def trained_then_resumed(rank: int, world: int, run_path: str, batches: list[dict]) -> list[str]:
    """Train on `batches` with a checkpoint after step 2; a second trainer resumes from it and trains the rest.
    Returns the names of the tensors (weights, AdamW moments) where the two end states differ."""
    run = load_run(run_path)
    straight = Trainer(run, None, rank, world)
    for batch in batches:
        straight.rl_step(Batch.from_json(batch))
        straight.step += 1
        if straight.step == 2:
            straight.save_checkpoint()
            straight.poll_checkpoint(wait=True)
    resumed = Trainer(run, None, rank, world)
    assert resumed.try_resume() and resumed.step == 2
    for batch in batches[2:]:
        resumed.rl_step(Batch.from_json(batch))
        resumed.step += 1
    a, b = full_state(straight), full_state(resumed)
    return [name for name in a if not torch.equal(a[name], b[name])]


def train_and_publish(rank: int, world: int, run_path: str, batch_json: dict) -> dict:
    """One RL step, then the weights published as version 1 (each rank writing its part); this rank's whole state
    and, on rank 0, the published version's tensors."""
    from moe_rl_eks.workloads.model.checkpoint import load_hf
    from moe_rl_eks.workloads.rl.protocol import VersionRef

    trainer = Trainer(load_run(run_path), None, rank, world)
    trainer.rl_step(Batch.from_json(batch_json))
    trainer.start_publishing()
    trainer.publish(1)
    trainer.stop_publishing()
    published = None
    if rank == 0:
        directory = trainer.store.fetch(VersionRef(trainer.lineage, 1), trainer.out / "fetched")
        published = load_hf(directory)[1]
    return {"state": full_state(trainer), "published": published}


def bf16_warmup(rank: int, world: int, run_path: str, steps: int) -> dict:
    """`steps` warm-up (supervised) steps on the same examples: their losses, the dtype the first layer's query
    projection computed in, its FSDP group's reduce dtype, and the dtypes of its sharded weight and gradient."""
    from moe_rl_eks.workloads.model.parallelize import local

    trainer = Trainer(load_run(run_path), None, rank, world)
    layer = trainer.model.model.layers[0]
    computed_in = []
    layer.self_attn.q_proj.register_forward_pre_hook(lambda module, args: computed_in.append(module.weight.dtype))
    grads, _ = step_gradients(trainer, _one_batch())
    losses = [trainer.sft_step(0) for _ in range(steps)]
    weight = layer.self_attn.q_proj.weight
    return {"losses": losses, "computed_in": computed_in[0],
            "reduce_dtype": layer._get_fsdp_state()._fsdp_param_group.mp_policy.reduce_dtype,
            "master_dtype": local(weight).dtype, "grad_dtype": next(g for n, g in grads.items() if n.endswith("layers.0.self_attn.q_proj.weight")).dtype,
            "grads": {name: whole(name, grad, trainer) for name, grad in grads.items()}}


def _one_batch() -> Batch:
    from test_trainer import varied_batch

    return varied_batch()
