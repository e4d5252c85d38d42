"""`moerl bench-engine-host`: the rollout engine's host time per step, apart from its device work, at a realistic
row count. The real engine (RolloutEngine: its loop, the replica, the scheduler, the KV-cache manager, the model
runner, the sampler) serves `--rows` rows (groups of `--n` sharing a prompt, `--new-tokens` each, EOS ignored)
with `--slots` decoding at once, on bench-rl --gpu --tiny's small model. Per engine step it reports the busy time,
the device's part (the forwards and sampling: moerl_rollout_device_seconds_total, CUDA events on a GPU, their wall
time on a CPU) and the host's part, busy minus device: on a GPU the time the device waits between steps. On a CPU
the host part is what the engine's Python costs per step (the model's compute is the device part); `--json` writes
the figures.

`--gpu`: bench-rl --gpu's standalone generation (`--layers` of the Qwen3-30B-A3B shape, triton compute, CUDA
graphs; `--rows` rows in groups of `--n`, each group's length drawn as bench-rl draws them, `--slots` at once)
twice, rollout.async_scheduling off then on, each with its decode step's device and host ms and the 100 ms
nvidia-smi samples taken during its generation (share at >= 90 % and mean utilisation).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.run import RunConfig
from moe_rl_eks.core.schema import parse


def measure(rows: int, slots: int, n: int, prompt_tokens: int, new_tokens: int, work: Path) -> dict:
    """Serve the rows through a RolloutEngine on version 0 of a tiny model (random weights); the per-step
    figures from the engine's own counters."""
    import torch

    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine, RowRequest, SamplingParams

    from . import rl_gpu

    # bench-rl --gpu --tiny's run at this size (its task's mean length is not used: the rows here are fixed)
    args = rl_gpu.parse_args(["--tiny", "--samples", str(rows), "--n", str(n), "--prompt-tokens", str(prompt_tokens),
                              "--max-tokens", str(new_tokens), "--mean-tokens", str(max(1, new_tokens // 2)),
                              "--batch-size", str(slots)])
    run = parse(RunConfig, rl_gpu.run_data(args, rl_gpu.TINY_LAYERS, work), source="bench-engine-host")
    store = DirectoryStore(work / "weights")
    torch.manual_seed(0)
    save_hf(MoETransformer(run.model).state_dict(), run.model, work / "initial")
    store.publish(0, work / "initial")
    engine = RolloutEngine(run, store, work / "cache", CharTokenizer())
    try:
        engine.load_version(0)
        vocab = run.model.vocab_size
        calls = [[RowRequest(tuple((g * 31 + i * 7) % (vocab - 1) + 1 for i in range(prompt_tokens)),
                             SamplingParams(new_tokens, seed=g * n + r, ignore_eos=True), f"g{g}", r)
                  for r in range(n)] for g in range(rows // n)]
        counters = (M.ROLLOUT_BUSY_SECONDS, M.ROLLOUT_DEVICE_SECONDS, M.ROLLOUT_STEPS, M.ROLLOUT_GENERATION_TOKENS)

        def read() -> list[float]:
            get = engine.metrics.registry.get_sample_value
            return [get(m.name) or 0.0 for m in counters]
        before, start = read(), time.perf_counter()
        for future in [engine.submit(call) for call in calls]:
            future.result(timeout=3600)
        wall = time.perf_counter() - start
        busy, device, steps, tokens = (b - a for a, b in zip(before, read()))
    finally:
        engine.stop()
    return {"rows": rows, "slots": slots, "n": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "steps": int(steps), "tokens": int(tokens), "wall_s": wall, "busy_ms_per_step": 1000 * busy / steps,
            "device_ms_per_step": 1000 * device / steps, "host_ms_per_step": 1000 * (busy - device) / steps,
            "host_share": (busy - device) / busy, "torch_threads": torch.get_num_threads()}


def measure_gpu(layers: int, rows: int, slots: int, n: int, prompt_tokens: int, mean_tokens: int,
                max_tokens: int) -> list[dict]:
    """The generation without and with async scheduling on the GPU, with the GPU's samples of each."""
    import dataclasses

    import torch

    from moe_rl_eks.core.rl_config import TaskConfig
    from moe_rl_eks.workloads.rl.data import RandomTokenSource

    from . import rollout as bench_rollout
    from .rl_gpu import GpuSampler, utilisation

    config = dataclasses.replace(bench_rollout.QWEN3_30B_A3B, num_hidden_layers=layers,
                                 max_position_embeddings=prompt_tokens + max_tokens)
    task = TaskConfig(name="random_tokens", prompt_tokens=prompt_tokens, mean_completion_tokens=mean_tokens)
    source = RandomTokenSource(task, 0, config.vocab_size, max_tokens)
    lengths = [p.max_tokens for p in (source.next() for _ in range(rows // n)) for _ in range(n)]
    model = bench_rollout.build_model(config, torch.device("cuda"), "triton")
    results = []
    for look_ahead in (False, True):
        sampler = GpuSampler()
        try:
            gen = bench_rollout.run_engine(model, rows, prompt_tokens, max_tokens, graphs=True, max_seconds=3600,
                                           lengths=lengths, slots=slots, look_ahead=look_ahead)
        finally:
            sampler.stop()
        gpu = utilisation(sampler.window(*gen["window"]))
        results.append({**gen, "layers": layers, "gpu_busy": gpu["busy"], "gpu_util_mean": gpu["mean_utilisation"],
                        "nvml_samples": gpu["samples"]})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moerl bench-engine-host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--slots", type=int, default=256, help="rollout.max_batch_size (rows decoding at once)")
    parser.add_argument("--n", type=int, default=16, help="rows per prompt (a GRPO group)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--gpu", action="store_true", help="the 30B shape's generation on the GPU, async scheduling "
                        "off and on (--new-tokens is then the longest drawn length)")
    parser.add_argument("--layers", type=int, default=8, help="--gpu: layers of the Qwen3-30B-A3B shape")
    parser.add_argument("--mean-tokens", type=int, default=2000, help="--gpu: mean drawn completion length")
    args = parser.parse_args(argv)
    if args.rows % args.n:
        parser.error(f"--rows {args.rows}: must be a multiple of --n ({args.n})")
    if args.gpu:
        results = measure_gpu(args.layers, args.rows, args.slots, args.n, args.prompt_tokens, args.mean_tokens,
                              args.new_tokens)
        for r in results:
            print(f"async scheduling {'on ' if r['look_ahead'] else 'off'}: {r['seconds']:.1f} s, "
                  f"{r['tokens_per_s']:,.0f} tok/s, {r['decode_steps']} decode steps of {r['step_ms']:.2f} ms = "
                  f"device {r['device_step_ms']:.2f} + host {r['host_step_ms']:.2f}; GPU busy "
                  f"{r['gpu_busy'] if r['gpu_busy'] is None else round(r['gpu_busy'], 2)} of {r['nvml_samples']} "
                  f"samples, mean utilisation "
                  f"{r['gpu_util_mean'] if r['gpu_util_mean'] is None else round(r['gpu_util_mean'], 2)}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as work:
        out = measure(args.rows, args.slots, args.n, args.prompt_tokens, args.new_tokens, Path(work))
    print(f"{out['rows']} rows, {out['slots']} at once, {out['steps']} steps: busy {out['busy_ms_per_step']:.2f} ms "
          f"per step = device {out['device_ms_per_step']:.2f} + host {out['host_ms_per_step']:.2f} "
          f"(host {out['host_share']:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
