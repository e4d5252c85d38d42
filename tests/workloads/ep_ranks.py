"""Run a function on N ranks (processes) and collect what rank 0 returns; the EP cases the CPU and GPU tests share.
Two placements: `shared` (gloo; CPU, or every rank on cuda:0, what one lent GPU allows) and `per_gpu` (NCCL,
rank r on cuda:r, as the trainer and a sharded server run). Imported by the tests by module name, so spawned
workers can unpickle these functions."""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers, gather_state
from moe_rl_eks.workloads.moe.parallel import ExpertParallel

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, rope_theta=10000.0,
                     router_aux_loss_coef=0.01, dtype="float32")


PLACEMENTS = ("shared", "per_gpu")


def placement(rank: int, world: int, mode: str, cuda_devices: int) -> tuple[str, torch.device | None]:
    """(process-group backend, this rank's CUDA device or None for CPU ranks). `shared` puts every rank on cuda:0
    when there is a GPU (gloo moves the bytes: NCCL cannot run two ranks on one GPU); `per_gpu` needs a GPU per
    rank."""
    if mode not in PLACEMENTS:
        raise ValueError(f"placement: mode {mode!r} is not one of {PLACEMENTS}")
    if mode == "shared":
        return "gloo", torch.device("cuda", 0) if cuda_devices else None
    if cuda_devices < world:
        raise ValueError(f"placement: mode 'per_gpu' needs one GPU per rank ({world} ranks), "
                         f"this machine has {cuda_devices}; use mode 'shared'")
    # CUDA tensors over NCCL, a CPU tensor's collectives (a decode loop's agreement flags) over gloo
    return "cpu:gloo,cuda:nccl", torch.device("cuda", rank)


def one_rank_per_gpu(world: int):
    """A `world` parameter for a per_gpu test, skipped with the reason on a machine with fewer GPUs."""
    have = torch.cuda.device_count()
    return pytest.param(world, marks=pytest.mark.skipif(have < world, reason=(
        f"one rank per GPU at {world} ranks needs {world} GPUs, this machine has {have}")))


def _entry(fn, rank, world, init_file, out_file, args, mode):
    torch.set_num_threads(1)
    transport, device = placement(rank, world, mode, torch.cuda.device_count())
    if device is not None:
        torch.cuda.set_device(device)  # "cuda" in fn now means this rank's GPU
    dist.init_process_group(transport, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            **({"device_id": device} if mode == "per_gpu" else {}))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save(result, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 120, start_method: str = "forkserver", mode: str = "shared"):
    """fn(rank, world, *args) on `world` processes of one group placed by `mode` (see `placement`); returns rank
    0's result."""
    placement(0, world, mode, torch.cuda.device_count())  # refuse here, not in every child
    # forkserver, not fork, on the CPU: see trainer_ranks.run_ranks (a forked rank aborted in glibc once in CI; the
    # preload named by package for the reason given there).
    ctx = mp.get_context(start_method)
    ctx.set_forkserver_preload(["moe_rl_eks.workloads.trainer.loop"])
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.pt")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, out_file, args, mode))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout} s")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with {codes}")
        return torch.load(out_file)


def _batch(rank: int, scenario: str, world: int, device, config: ModelConfig):
    gen = torch.Generator().manual_seed(100 + rank)
    sequences = 0 if scenario in ("rank_sends_none", "packed_recomputed") and rank == world - 1 else 2
    ids = torch.randint(0, config.vocab_size, (sequences, 8), generator=gen)
    replay = None
    if scenario == "skewed":
        # Every token of every rank to experts 0 and 1 (rank 0's): the other ranks' experts get nothing and
        # rank 0 sends to nobody else.
        replay = [torch.tensor([0, 1]).expand(sequences, 8, 2).to(device) for _ in range(config.num_hidden_layers)]
    return ids.to(device), replay


def _loss(out) -> torch.Tensor:
    # A sum, not a mean: a rank with no tokens contributes 0, not NaN.
    return out.logits.float().square().sum() / 100 + out.aux_loss


def _gather_objects(obj, world):
    parts = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


def compare_backends(rank: int, world: int, backends: tuple[str, ...], device: str, dtype_name: str,
                     scenarios: tuple[str, ...], config: ModelConfig = CONFIG) -> dict:
    """For each scenario and backend: every rank's logits, the total loss and the full gradients, run as
    `local` (one process, all ranks' batches, same weights) or EP over this group. dtype_name "bf16-autocast":
    float32 weights under bf16 autocast (the GPU trainer's mixed precision)."""
    autocast = dtype_name == "bf16-autocast"
    dtype = torch.float32 if autocast else getattr(torch, dtype_name)
    torch.manual_seed(0)
    full = MoETransformer(config).state_dict()
    results: dict = {}
    for scenario in scenarios:
        batches = [_batch(r, scenario, world, device, config) for r in range(world)]
        for backend in backends:
            if backend == "local":
                model = MoETransformer(config).to(device, dtype)
                model.load_state_dict(full)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    outs = [model(ids, routing_replay=replay) for ids, replay in batches]
                logits = [o.logits.detach().float().cpu() for o in outs]
                loss = sum(_loss(o) for o in outs)
                loss.backward()
                grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
                results[scenario, backend] = dict(logits=logits, loss=loss.item(), grads=grads)
                continue
            ep = ExpertParallel(dist.group.WORLD, backend, device=device)
            model = MoETransformer(config, ep=ep).to(device, dtype)
            model.load_full_state_dict(full)
            ids, replay = batches[rank]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                if scenario == "packed_recomputed":
                    # The trainer's micro-batch: this rank's sequences packed into one row, layers recomputed in
                    # the backward (their all-to-alls replayed); the local reference runs them unpacked, whole.
                    checkpoint_layers(model, "save_attention")
                    out = model(ids.reshape(1, -1), sequence_lengths=[ids.shape[1]] * ids.shape[0])
                    out.logits = out.logits.view(*ids.shape, config.vocab_size)
                else:
                    out = model(ids, routing_replay=replay)
            loss = _loss(out)
            loss.backward()
            ep.sum_replicated_grads(replicated(model))
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.float().cpu()
                grads[name] = torch.cat(_gather_objects(g, world)) if ".mlp.experts." in name else g
            results[scenario, backend] = dict(logits=_gather_objects(out.logits.detach().float().cpu(), world),
                                              loss=sum(_gather_objects(loss.item(), world)), grads=grads)
    return results


def replicated(model) -> list[torch.Tensor]:
    """The weights every EP rank holds a copy of: all but the experts."""
    return [p for name, p in model.named_parameters() if ".mlp.experts." not in name]


def train_toy(rank: int, world: int, steps: int, checkpoint_dir: str) -> dict:
    """EP training on next-token prediction of a fixed cycle; returns the global loss per step, the final
    logits of rank 0's batch, and rank 1's expert slice, after saving an HF checkpoint from the EP ranks."""
    from moe_rl_eks.workloads.model.checkpoint import save_hf

    from moe_rl_eks.core.run import RunConfig, resolve_run

    torch.manual_seed(0)
    resolved = resolve_run(RunConfig(name="toy", model=CONFIG), None)  # a local run: `auto` -> alltoall on gloo
    ep = ExpertParallel.for_run(resolved, dist.group.WORLD)
    model = MoETransformer(CONFIG, ep=ep)
    full = MoETransformer(CONFIG).state_dict()
    model.load_full_state_dict(full)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    cycle = torch.arange(0, 48, 3)
    starts = torch.arange(4) + 4 * rank
    ids = torch.stack([cycle.roll(-int(s)) for s in starts])
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, CONFIG.vocab_size), ids[:, 1:].reshape(-1))
        (loss + out.aux_loss).backward()
        ep.sum_replicated_grads(replicated(model))
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state, bf16 = gather_state(model), gather_state(model, torch.bfloat16)
    if rank == 0:
        save_hf(state, CONFIG, checkpoint_dir)
    else:
        assert state is None and bf16 is None, "only EP rank 0 receives the gathered state"
    slices = _gather_objects(model.model.layers[0].mlp.experts.down_proj.detach().clone(), world)
    with torch.no_grad():
        final = model(ids[:, :-1]).logits
    return dict(losses=losses, ids=ids, logits=final, rank1_down_proj=slices[1], backend=ep.backend,
                bf16_down_proj=bf16 and bf16["model.layers.0.mlp.experts.down_proj"])


def parallelized_against_constructed(rank: int, world: int) -> dict:
    """The model laid out by `parallelize` from the meta device against `MoETransformer(ep=...)` on the same
    weights and tokens: names of the tensors (loss, gradients) that differ on any rank, and the expert shape."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe_rl_eks.workloads.model.parallelize import ParallelPlan, load_full_state, parallelize
    from moe_rl_eks.workloads.model.transformer import expert_slice
    from moe_rl_eks.workloads.moe.parallel import local_experts

    torch.manual_seed(0)
    full = MoETransformer(CONFIG).state_dict()
    constructed = MoETransformer(CONFIG, ep=ExpertParallel(dist.group.WORLD, "alltoall"))
    constructed.load_full_state_dict(full)
    with torch.device("meta"):
        seamed = MoETransformer(CONFIG)
    ep = parallelize(seamed, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), ParallelPlan(ep_degree=world))
    seamed.to_empty(device="cpu")
    load_full_state(seamed, expert_slice(full, local_experts(ep, CONFIG.num_experts)))
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank))
    results = []
    for model in (constructed, seamed):
        out = model(ids)
        loss = out.logits.square().mean() + out.aux_loss
        loss.backward()
        results.append({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}})
    differ = [name for name, want in results[0].items() if not torch.equal(results[1][name], want)]
    everyone = [None] * world
    dist.all_gather_object(everyone, differ)
    return {"differ": sorted({name for names in everyone for name in names}), "names": sorted(results[1]),
            "expert_shape": tuple(seamed.model.layers[0].mlp.experts.gate_up_proj.shape)}


def sharded_state_bytes(rank: int, world: int, config: ModelConfig) -> dict:
    """This rank's float32 bytes of parameters, gradients and AdamW moments of `config`'s model laid out by the
    trainer's FSDP plan on the meta device (nothing allocated): the sharded parameters themselves, gradients and
    moments as AdamW makes them after one step on zero gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe_rl_eks.workloads.model.parallelize import ParallelPlan, local, parallelize

    with torch.device("meta"):
        model = MoETransformer(config)
    parallelize(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
                ParallelPlan(ep_degree=world, fsdp=True))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()

    def nbytes(tensors) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)
    moments = [v for state in optimizer.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"parameter_bytes": nbytes(params), "gradient_bytes": nbytes(p.grad for p in params),
            "optimizer_bytes": nbytes(moments)}
