"""`moerl plan --model NAME|DIR --instance-type T [--nodes N]`: what a training run needs per GPU and how long its
step takes, from the torch-free planner (core/planner.py): memory per GPU by kind, whether N nodes hold it, the
smallest node count that does, the predicted step time with NCCL all-to-all and with DeepEP over EFA, the longest
single sample a micro-batch trains with and without context parallelism, and the rollout pool's weights and KV
capacity per GPU. Nothing is downloaded and torch is not imported."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from moe_rl_eks.core import memory, planner
from moe_rl_eks.core.catalog import CATALOG, instance_type
from moe_rl_eks.core.hf_config import CheckpointError, model_config
from moe_rl_eks.core.models import KNOWN_MODELS, known_model
from moe_rl_eks.core.run import ModelConfig

GIB = 2**30


def load_model(spec: str) -> ModelConfig:
    """A known name, or a checkpoint directory (its config.json)."""
    path = Path(spec)
    if (path / "config.json").is_file():
        return model_config(json.loads((path / "config.json").read_text()), source=str(path / "config.json"))
    return known_model(spec)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl plan", description=__doc__)
    p.add_argument("--model", required=True, help=f"a known name ({', '.join(KNOWN_MODELS)}) or a checkpoint "
                   "directory with a config.json")
    p.add_argument("--instance-type", default="p5en.48xlarge", choices=sorted(CATALOG), metavar="TYPE",
                   help="trainer instance type (default p5en.48xlarge)")
    p.add_argument("--nodes", type=positive, help="trainer nodes to check (default: the smallest that fits)")
    p.add_argument("--ep-backend", choices=("alltoall", "deepep"), default="alltoall",
                   help="the expert all-to-all whose traffic the step time counts (both are printed)")
    p.add_argument("--microbatch-tokens", type=positive, default=planner.TrainingShape.microbatch_tokens)
    p.add_argument("--tokens-per-step", type=positive, default=planner.TrainingShape.tokens_per_step)
    p.add_argument("--sequence", type=positive, default=planner.TrainingShape.sequence,
                   help="mean sample length in tokens (attention's cost)")
    p.add_argument("--checkpointing", choices=("off", "full", "save_attention"), default="save_attention")
    p.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="replicate the dense weights (no FSDP2)")
    p.add_argument("--reference", action="store_true", help="a float32 KL reference beside the policy")
    p.add_argument("--expert-parallel", type=positive, help="ranks per EP group (rl.training.expert_parallel; "
                   "default every rank): fewer shard the experts' copies with FSDP")
    p.add_argument("--fsdp-param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="what FSDP gathers parameters in (rl.training.fsdp_param_dtype)")
    p.add_argument("--context-parallel", type=positive, default=1,
                   help="ranks sharing each micro-batch (rl.training.context_parallel); the longest-sample line "
                   "compares it with none")
    p.add_argument("--rollout-gpus", type=positive, default=8, help="GPUs per rollout server (its EP split)")
    p.add_argument("--rollout-memory-share", type=float, default=0.9,
                   help="the share of a rollout GPU's memory the engine may use (weights + KV cache)")
    return p.parse_args(argv)


def table(plans: list[planner.Plan]) -> str:
    head = ("| nodes | GPUs | params | grads | AdamW | reference | activations | FSDP gathered | total GiB/GPU | of "
            "| fits | step s (compute + NVLink + EFA + FSDP) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for p in plans:
        m = p.memory
        rows.append(f"| {p.nodes} | {p.ranks} | {m.parameters / GIB:.1f} | {m.gradients / GIB:.1f} | "
                    f"{m.optimizer / GIB:.1f} | {m.reference / GIB:.1f} | {m.activations / GIB:.1f} | "
                    f"{m.gathered / GIB:.1f} | {m.total / GIB:.1f} | {p.gpu_bytes / GIB:.0f} | "
                    f"{'yes' if p.fits else 'no'} | {p.step.total_s:.2f} ({p.step.compute_s:.2f} + "
                    f"{p.step.nvlink_s:.2f} + {p.step.efa_s:.2f} + {p.step.fsdp_s:.2f}) |")
    return "\n".join([head, *rows])


def longest_sample_line(model: ModelConfig, instance, nodes: int, backend: str, shape: planner.TrainingShape) -> str:
    """The longest single sample on `nodes` nodes with the shape's context parallelism, and without it."""
    parts = []
    for cp in sorted({1, shape.context_parallel}):
        best = planner.longest_sample(model, instance, nodes, backend=backend,
                                      shape=replace(shape, context_parallel=cp))
        if best is None:
            parts.append(f"CP {cp}: not even 1,024 tokens fit")
            continue
        parts.append(f"CP {cp}: {best.shape.microbatch_tokens:,} tokens ({best.memory.activations / GIB:.1f} GiB of "
                     f"activations, {best.memory.total / GIB:.1f} GiB/GPU; step {best.step.total_s:.2f} s at that "
                     f"length, {best.step.nvlink_s:.2f} s of it NVLink all-to-alls)")
    return f"longest sample on {nodes} node(s), one micro-batch of it: " + "; ".join(parts)


def rollout_line(m: ModelConfig, instance, gpus: int, share: float) -> str:
    experts = m.routed_expert_parameter_count()
    need = memory.rollout_memory(replicated=m.parameter_count() - experts, experts=experts, gpus=gpus,
                                 dtype_bytes=m.bytes_per_parameter, layers=m.num_hidden_layers,
                                 kv_heads=m.num_key_value_heads, head_dim=m.head_dim)
    have = share * instance.gpu_memory_mib * 2**20
    kv_tokens = max(0, int((have - need.fixed_bytes) // need.per_token_bytes))
    return (f"rollout server of {gpus} x {instance.gpu_model}: {need.fixed_bytes / GIB:.1f} GiB of weights per GPU "
            f"({m.dtype}), KV cache room for {kv_tokens:,} tokens per GPU at a {share} memory share "
            f"({need.per_token_bytes / 1024:.0f} KiB per token)")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        model = load_model(args.model)
    except (KeyError, CheckpointError) as exc:
        print(f"moerl plan: --model: {exc.args[0]}", file=sys.stderr)
        return 2
    if not 0 < args.rollout_memory_share <= 1:
        print(f"moerl plan: --rollout-memory-share: {args.rollout_memory_share} must be in (0, 1]", file=sys.stderr)
        return 2
    instance = instance_type(args.instance_type)
    shape = planner.TrainingShape(args.microbatch_tokens, args.tokens_per_step, args.sequence, args.checkpointing,
                                  args.fsdp, args.reference, args.expert_parallel, args.fsdp_param_dtype,
                                  args.context_parallel)
    try:
        smallest = planner.smallest_fit(model, instance, backend=args.ep_backend, shape=shape)
        nodes = sorted({n for n in (args.nodes, smallest.nodes if smallest else None) if n})
        plans = [planner.plan(model, instance, n, backend=args.ep_backend, shape=shape) for n in nodes]
    except ValueError as exc:
        print(f"moerl plan: {exc}", file=sys.stderr)
        return 2
    layout = (f"EP groups of {args.expert_parallel} ranks, the experts' copies sharded" if args.expert_parallel
              else "EP over every rank")
    print(f"{args.model}: {model.parameter_count() / 1e9:.1f} B parameters "
          f"({(model.parameter_count() - model.routed_expert_parameter_count()) / 1e9:.2f} B dense), "
          f"{model.num_hidden_layers} layers; trainer on {instance.name} ({instance.gpus} x {instance.gpu_model}), "
          f"{layout}, "
          f"{'FSDP2 of the dense weights' if args.fsdp else 'dense weights replicated'} "
          f"({args.fsdp_param_dtype} gathers), CP {args.context_parallel}, "
          f"{args.checkpointing} checkpointing, {args.microbatch_tokens:,}-token micro-batches, "
          f"{args.tokens_per_step:,} tokens a step ({args.ep_backend} traffic)")
    if plans:
        print(table(plans))
    if smallest is None:
        print(f"no node count up to 256 holds it on {instance.name}")
    else:
        print(f"smallest trainer that fits: {smallest.nodes} x {instance.name}")
    for plan in plans:
        other = "deepep" if args.ep_backend == "alltoall" else "alltoall"
        alt = planner.plan(model, instance, plan.nodes, backend=other, shape=shape)
        print(f"{plan.nodes} node(s): step {plan.step.total_s:.2f} s with {args.ep_backend}, "
              f"{alt.step.total_s:.2f} s with {other}")
    for plan in plans:
        print(longest_sample_line(model, instance, plan.nodes, args.ep_backend, shape))
    print(rollout_line(model, instance, args.rollout_gpus, args.rollout_memory_share))
    return 0 if args.nodes is None or (plans and next(p for p in plans if p.nodes == args.nodes).fits) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
