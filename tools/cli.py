"""`moerl`: one console script; each subcommand lives with the part it belongs to and is imported lazily,
so `moerl manifests` never loads torch and `moerl train` never loads the CDK. The table sits in tools/, the top
room, so every module it names is below it (tests/test_layout.py)."""
from __future__ import annotations

import gc
import importlib
import sys

# subcommand -> (module, function, one-line help). The function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "synth-summary": ("moe_rl_eks.infra.summary", "main", "summarise the synthesized CloudFormation in cdk.out/"),
    "manifests": ("moe_rl_eks.k8s.manifests", "main", "write a run's Kubernetes manifests to dist/<env>/<run>/"),
    "bench-ep": ("moe_rl_eks.tools.bench.ep", "main", "EP dispatch + combine throughput per backend (DeepEP method)"),
    "bench-kernels": ("moe_rl_eks.kernels.bench", "main", "MoE layer torch vs triton backend on one GPU, fwd and fwd+bwd"),
    "bench-train": ("moe_rl_eks.tools.bench.train", "main",
                    "trainer micro-batch tokens/s, MFU and memory on one GPU (Qwen3-30B-A3B layers)"),
    "bench-train-attention": ("moe_rl_eks.tools.bench.train_attention", "main",
                              "the trainer's causal attention, flash vs cuDNN, per sequence length on one GPU"),
    "serve-rollout": ("moe_rl_eks.workloads.rollout.serve", "main", "serve completions (rollout server role)"),
    "orchestrate": ("moe_rl_eks.workloads.orchestrator.app", "main", "drive rollouts, score, batch (orchestrator role)"),
    "train": ("moe_rl_eks.workloads.trainer.loop", "main", "train with EP inside (trainer role; run under torchrun)"),
    "local-run": ("moe_rl_eks.tools.local_run", "main", "the whole RL loop on this machine"),
    "eval": ("moe_rl_eks.tools.evaluate", "main",
             "evaluate a Hugging Face checkpoint on a dataset: reward, pass@1/pass@k, length, truncation"),
    "example-data": ("moe_rl_eks.tools.example_data", "main",
                     "write the local real-data example: a BPE tokenizer directory and word-problem Parquet files"),
    "bench-rl": ("moe_rl_eks.tools.bench.rl", "main", "synchronous vs asynchronous RL, side by side"),
    "bench-ppo": ("moe_rl_eks.tools.bench.ppo", "main", "PPO (learned critic) vs GRPO on the CPU countdown task, seeds"),
    "bench-generation": ("moe_rl_eks.tools.bench.generation", "main",
                         "rollout decoding with a group's prompt prefilled once vs per row"),
    "bench-rollout": ("moe_rl_eks.tools.bench.rollout", "main",
                      "rollout engine on one GPU vs transformers and the weight-read roofline (needs CUDA)"),
    "bench-engine-host": ("moe_rl_eks.tools.bench.engine_host", "main",
                          "the rollout engine's host time per step apart from its device work, at N rows"),
    "bench-server": ("moe_rl_eks.tools.bench.server", "main",
                     "the rollout server's HTTP cost over its engine (tokens/s and latency per concurrency)"),
    "bench-routing": ("moe_rl_eks.tools.bench.routing", "main",
                      "routing replay's store at 1,024 x 8k-token samples: bytes/s written, read, orchestrator RSS"),
    "bench-load": ("moe_rl_eks.tools.bench.load", "main",
                   "a served checkpoint's cold read against dd iflag=direct on the same files"),
    "bench-weights": ("moe_rl_eks.tools.bench.weights", "main",
                      "weight publication and loading stage by stage against the disk's bandwidth (GPU)"),
    "plan": ("moe_rl_eks.tools.plan", "main",
             "per-GPU memory, the smallest trainer that fits and the step time, for a model on N nodes"),
    "doctor": ("moe_rl_eks.tools.doctor", "main", "can this container do its role here (GPU, NCCL, EFA, DeepEP)"),
    "preflight": ("moe_rl_eks.tools.preflight", "main", "check an AWS account can hold an environment (boto3)"),
    "scale-pool": ("moe_rl_eks.tools.scale_pool", "main",
                   "size a Capacity Block pool once its block is active (boto3)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: moerl <command> [args]\n\ncommands:")
        for name, (_, _, help_) in SUBCOMMANDS.items():
            print(f"  {name:16} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"moerl: unknown command {name!r}; known: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    code = main()
    # The interpreter's last collection walks every object a role made (torch's modules, the model, gloo's
    # groups): 0.5 s for a process that imported torch, 1.5 s for a trainer rank, on 2 cores, spent before the
    # exit that torchrun, a restart or a test waits on. Frozen objects are skipped; atexit handlers (logging's
    # flush and close) still run.
    gc.freeze()
    sys.exit(code)
