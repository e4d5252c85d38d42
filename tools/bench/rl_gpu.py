"""`moerl bench-rl --gpu`: the RL-system benchmark on one GPU (issue 25 item 4). The real loop (a rollout server,
the orchestrator and the trainer, each its own process, colocated by memory shares as `local_gpus:` places them)
on `--layers` layers of the Qwen3-30B-A3B shape with random weights: GRPO groups of `--n`, `--prompt-tokens`
random prompt tokens, each request's max_tokens drawn log-uniformly with mean `--mean-tokens` up to `--max-tokens`
(rl.task random_tokens), EOS ignored (rl.sampling.ignore_eos: every row runs to its drawn length), `--samples`
samples per step; one command per mode: `--mode sync` (max_staleness 0) or `--mode async --staleness N`.

Per step: the trainer's wait for its batch (idle: generation and the rollout's weight load, in sync mode),
logprob scoring (before the first update; none for GRPO's single update), training, publication (the snapshot on
the trainer's critical path), the rest (batch transfer, bookkeeping); beside them the rollout server's generating
seconds (of them the device's forwards and sampling, and the engine's host work between them, over its engine
steps) and its load of the newest version. The trainer's fields come from its metrics.jsonl, the rollout's from its
/metrics counters read as each step's record appears (every 0.1 s). GPU busy: the share of 100 ms NVML samples
(nvidia-smi) at >= 90 % utilisation over the steps after the first (the first includes compilation and start-up),
beside their mean utilisation; both also by phase, from what ran when each sample was taken (the rollout
generating: its busy counter read every 0.5 s; the trainer computing: its rows' times), and the samples
themselves in the results (`nvml_trace`).

`--standalone` (the default for `--mode sync`) first measures, in a child process holding the GPU alone, what the
parts do alone: the first measured step's requests (its prompts' drawn lengths) through the engine's decoder with
the server's batch size (tools/bench/rollout.run_engine) and the trainer's step, recomputing as the loop's does,
on packed micro-batches of the mean sample length (tools/bench/train.measure). Targets: that sync step <= 1.15 x
its parts alone (its generation alone + its tokens at the standalone training rate + the loop's publication and
load); async samples/s >= 1.1 x the sync
run's (`--compare` a sync results.json); GPU busy >= 90 %.

`--placement split` (issue 30, an nvidia-h200-x2): the trainer on GPU 0 and the rollout server on GPU 1, each
with its GPU to itself (memory shares default 0.9 each), the orchestrator on the CPU; versions go through the store
(over device memory only when colocated). Such a run is refused on a machine with fewer than 2 GPUs, naming the
field. The parts alone then are each role holding a GPU alone, so the split targets are async samples/s >= 0.85 x
min(rollout alone, trainer alone) (the sync run's standalone figures, through `--compare`, when the async run has
none) and every measured version installed on the server (its weight-version gauge, read every 0.5 s) within
the trainer's step time of its publication starting (`deliveries`, per version, in both placements); NVML samples
are taken on both GPUs (`nvml_by_gpu`).

Before launching, the run's memory is checked with core/memory.py (check_local_machine): if `--layers` do not fit
the GPU at the given shares, the largest layer count that does is taken, and the reason printed. `--tiny` runs the
same code path on the CPU with a small model (the test)."""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

import yaml

from moe_rl_eks.core.run import ConfigError, RunConfig, check_local_gpus, check_local_machine
from moe_rl_eks.core.schema import parse

from ..local_run import LocalCluster, gpu_memory_bytes, read_metrics
from .rollout_counters import rollout_counters

QWEN3_LAYERS = 48  # Qwen3-30B-A3B's depth: per-layer figures are scaled by layers / 48 to set beside the whole model
NEMO_RL_TOKENS_PER_GPU = 1102  # NeMo-RL, Qwen3-30B-A3B on 32 H100s, on-policy (tokens/s per GPU)
SYNC_OVERHEAD_TARGET = 1.15  # a sync step within this of its parts measured alone
ASYNC_SPEEDUP_TARGET = 1.1  # async samples/s over sync's
SPLIT_ASYNC_TARGET = 0.85  # split placement: async samples/s over the slower part's alone
BUSY_TARGET = 0.9  # share of NVML samples at >= BUSY_UTILISATION
BUSY_UTILISATION = 90
POLL_S = 0.1
# How often the rollout's busy counter is read to place generation in time (the NVML samples' phases): coarse
# enough that the scrapes cost the server's engine thread nothing measurable, fine beside steps of a minute.
PHASE_POLL_S = 0.5
PHASES = ("generation", "training", "both", "neither")
TINY_LAYERS = 2  # --tiny: bench-rollout's small model's depth
# (trainer GPU, rollout GPU) and default (trainer, rollout) memory shares by --placement. Colocated: the trainer's
# float32 state at 8 layers is ~86 GiB, its activations (full checkpointing, 16k-token micro-batches) ~5.5 GiB, the
# bf16 export ~10.4 GiB (at 0.70 the trainer ran out of memory at its second step on the H200, 2026-12-02); the
# rollout's bf16 weights ~10.4 GiB, its in-flight swap's staging and the KV cache the rest. Split: each role alone
# on its GPU, with vLLM's default 0.9 (the rest for the CUDA context and NCCL's buffers).
PLACEMENTS = {"colocated": ((0, 0), (0.76, 0.22)), "split": ((0, 1), (0.9, 0.9))}


def model_data(layers: int, max_positions: int, tiny: bool) -> dict:
    from .rollout import QWEN3_30B_A3B, TINY

    shape = TINY if tiny else QWEN3_30B_A3B
    return asdict(replace(shape, num_hidden_layers=layers, max_position_embeddings=max_positions))


def run_data(args: argparse.Namespace, layers: int, root: Path) -> dict:
    """The benchmark's run file (a mapping) for one mode."""
    prompts = args.samples // args.n
    longest = args.prompt_tokens + args.max_tokens
    staleness = 0 if args.mode == "sync" else args.staleness
    data = {
        "name": f"bench-rl-gpu-{args.mode}{args.staleness if args.mode == 'async' else ''}",
        "model": model_data(layers, longest, args.tiny),
        "moe_compute": "torch" if args.tiny else "triton",
        "parallelism": {"ep_backend": "local", "ranks_per_node": 1},
        "rollout": {"min_servers": 1, "max_servers": 1, "max_batch_size": args.batch_size,
                    "max_new_tokens": args.max_tokens, "min_row_tokens_per_s": 5, "hung_after_s": 900,
                    "async_scheduling": args.async_scheduling},
        "rl": {"algorithm": {"name": "grpo", "group_size": args.n, "kl_coef": 0.0},
               "task": {"name": "random_tokens", "prompt_tokens": args.prompt_tokens,
                        "mean_completion_tokens": args.mean_tokens},
               "evaluation": {"snapshots": False},
               "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens, "max_prompt_tokens": args.prompt_tokens,
                            "max_n": args.n, "ignore_eos": True},
               "orchestrator": {"max_staleness": staleness,
                                # every group of a step in flight at once: the server's batch, not the orchestrator,
                                # bounds the rows decoding
                                "max_inflight_requests": prompts * (1 + staleness),
                                # deadlines (core/deadlines.py): an 8,192-token row at the floor rate of 5 tok/s fits
                                "request_timeout_s": 3600, "straggler_after_s": 600},
               "weights": {"keep_versions": 2},
               # one more step than measured and no checkpoint: the benchmark stops the run after its last
               # measured step (a checkpoint of the 30B shape's float32 state is tens of GB of disk)
               "training": {"steps": args.steps + 1, "prompts_per_step": prompts, "warmup_sft_steps": 0,
                            "checkpoint_every": 10**6, "activation_checkpointing": "off" if args.tiny else "full",
                            "max_tokens_per_microbatch": max(args.microbatch_tokens, longest),
                            "output_dir": str(root / "run")}},
    }
    if not args.tiny:
        trainer_gpu, rollout_gpu = PLACEMENTS[args.placement][0]
        data["local_gpus"] = {"trainer": {"gpus": [trainer_gpu], "memory_share": args.trainer_share},
                              "rollout": {"gpus": [rollout_gpu], "memory_share": args.rollout_share}}
    return data


def check_gpus(args: argparse.Namespace, root: Path, gpu_count: int) -> None:
    """Refuse a placement naming a GPU this machine lacks (split on one GPU) before any memory check: the
    layer search would take the refusal for layers that do not fit."""
    run = parse(RunConfig, run_data(args, args.layers, root), source="bench-rl --gpu")
    try:
        check_local_gpus(run, gpu_count, source=f"bench-rl --gpu --placement {args.placement}")
    except ConfigError as error:
        raise SystemExit(f"{error} (--placement split needs 2 GPUs: device kind nvidia-h200-x2)") from None


def fitting_layers(args: argparse.Namespace, root: Path, gpu_bytes: list[int]) -> tuple[int, str | None]:
    """The largest layer count <= --layers whose run fits the GPU at the given shares (core/memory.py, through
    check_local_machine), and why --layers did not (None when it did)."""
    why = None
    for layers in range(args.layers, 0, -1):
        run = parse(RunConfig, run_data(args, layers, root), source="bench-rl --gpu")
        try:
            check_local_machine(run, gpu_bytes, source="bench-rl --gpu")
            return layers, why
        except ConfigError as error:
            why = why or str(error)
    raise SystemExit(f"bench-rl --gpu: not even one layer fits: {why}")


class GpuSampler:
    """GPU `gpu`'s utilisation every 100 ms from `nvidia-smi -lms 100` (pynvml is not assumed), each sample at the
    time nvidia-smi stamped it (its output may reach us in blocks); none on a machine without nvidia-smi."""

    def __init__(self, gpu: int = 0) -> None:
        self.samples: list[tuple[float, int]] = []  # (Unix time, utilisation %)
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu",
                                          "--format=csv,noheader,nounits", "-i", str(gpu), "-lms", "100"],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            stamp, _, utilisation = line.rpartition(",")
            if utilisation.strip().isdigit():  # "[N/A]" and headers are not samples
                when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as printed
                self.samples.append((when, int(utilisation)))

    def window(self, start: float, end: float) -> list[tuple[float, int]]:
        """The samples stamped within [start, end]."""
        return [(t, u) for t, u in self.samples if start <= t <= end]

    def busy(self, start: float, end: float) -> tuple[float | None, int]:
        """The share of samples in [start, end] at >= BUSY_UTILISATION, and how many samples there were."""
        window = [u for _, u in self.window(start, end)]
        return (sum(u >= BUSY_UTILISATION for u in window) / len(window) if window else None), len(window)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def utilisation(samples: list[tuple[float, int]]) -> dict:
    """Samples (time, utilisation %): how many, the share at >= BUSY_UTILISATION (the issue's busy) and the mean
    utilisation as a fraction (a phase at 80 % counts 0 busy but 0.8 mean)."""
    values = [u for _, u in samples]
    if not values:
        return {"samples": 0, "busy": None, "mean_utilisation": None}
    return {"samples": len(values), "busy": sum(u >= BUSY_UTILISATION for u in values) / len(values),
            "mean_utilisation": sum(values) / len(values) / 100}


def generating_spans(track: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """From readings (Unix time, the rollout's busy seconds): the intervals between readings in which the server
    generated for at least half the interval."""
    return [(t0, t1) for (t0, b0), (t1, b1) in zip(track, track[1:]) if t1 > t0 and (b1 - b0) / (t1 - t0) >= 0.5]


def training_spans(rows: list[dict]) -> list[tuple[float, float]]:
    """Each trainer step's compute (logprob scoring and training) in Unix time: a metrics row is written at
    `time`, after `step_seconds` of compute (`step_compute_seconds`) then publication."""
    return [(r["time"] - r["step_seconds"], r["time"] - r["step_seconds"] + r["step_compute_seconds"]) for r in rows]


def phase_split(samples: list[tuple[float, int]], generating: list[tuple[float, float]],
                training: list[tuple[float, float]]) -> dict:
    """The samples by what ran when each was taken (the rollout generating, the trainer computing, both, neither),
    each phase's share of the samples and its utilisation (`utilisation`)."""
    def within(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)
    by_phase: dict[str, list[tuple[float, int]]] = {phase: [] for phase in PHASES}
    for t, u in samples:
        gen, train = within(t, generating), within(t, training)
        by_phase["both" if gen and train else "generation" if gen else "training" if train else "neither"].append((t, u))
    return {phase: {**utilisation(part), "share": len(part) / len(samples) if samples else None}
            for phase, part in by_phase.items()}


def breakdown(rows: list[dict], counters: list[dict], prompt_tokens: int) -> list[dict]:
    """Each step's parts from the trainer's metrics rows and the rollout counters read as each row appeared
    (counters[0]: before the first step). Seconds: step (between the rows' wall times), idle (the trainer waiting
    for its batch), score, train, publish (the snapshot), other (the step's rest), generation (the rollout
    server generating; of it the device's forwards and sampling, and the engine's host work between them, with
    the engine steps they took), load (its load of the newest version); tokens: trained (prompt + completion) and
    generated."""
    from moe_rl_eks.core import metrics as M

    steps, wall, waited = [], 0.0, 0.0
    for row, before, after in zip(rows, counters, counters[1:]):
        idle_total = row["trainer_idle_fraction"] * row["wall_seconds"]
        score = row["score_seconds"]
        publish = row[M.WEIGHT_PUBLISH_SECONDS.name]
        part = {"step": row["step"], "step_s": row["wall_seconds"] - wall, "idle_s": idle_total - waited,
                "score_s": score, "train_s": row["step_compute_seconds"] - score, "publish_s": publish,
                "generation_s": after["busy_seconds"] - before["busy_seconds"], "load_s": after["load_seconds"],
                "rollout_device_s": after["device_seconds"] - before["device_seconds"],
                "engine_steps": after["engine_steps"] - before["engine_steps"],
                "trained_tokens": row["tokens"] + row["samples"] * prompt_tokens, "samples": row["samples"],
                "generated_tokens": after["generated_tokens"] - before["generated_tokens"],
                "staleness": row["staleness_mean"]}
        part["other_s"] = part["step_s"] - part["idle_s"] - score - part["train_s"] - publish
        part["rollout_host_s"] = part["generation_s"] - part["rollout_device_s"]
        steps.append(part)
        wall, waited = row["wall_seconds"], idle_total
    return steps


def deliveries(rows: list[dict], served_at: dict[int, float]) -> list[dict]:
    """Each trained version's way to the server: from the trainer starting to publish it (its metrics row is
    written after publication) to the rollout server first read serving it or a newer one (`served_at`: version ->
    Unix time its weight-version gauge was first read at it; a version served between two readings, or skipped
    for a newer one, counts as there by the reading that shows the newer), beside the trainer's step (scoring and
    training); delivery_s is None for a version not there before the run stopped."""
    from moe_rl_eks.core import metrics as M

    out = []
    for row in rows:
        published = row["time"] - row[M.WEIGHT_PUBLISH_SECONDS.name]
        seen = min((t for version, t in served_at.items() if version >= row["version"]), default=None)
        out.append({"version": row["version"], "delivery_s": None if seen is None else seen - published,
                    "trainer_step_s": row["step_compute_seconds"]})
    return out


def rate(amount: float, seconds: float) -> float | None:
    """amount / seconds; None for a window with no time in it (a tiny model's steps within one poll)."""
    return amount / seconds if seconds > 0 else None


def summarize(steps: list[dict], layers: int, standalone: dict | None, busy: float | None,
              delivered: list[dict] | None = None) -> dict:
    """Throughputs and targets over the steps after the first (the first includes start-up and compilation;
    all of them when there is one); of the rollout's generating time, the engine's host share and its host ms per
    engine step (the time the GPU waits between the device's forwards)."""
    steady = steps[1:] or steps
    seconds = sum(s["step_s"] for s in steady)
    tokens = sum(s["trained_tokens"] for s in steady)
    out = {"steps_measured": [s["step"] for s in steady], "step_s_median": statistics.median(s["step_s"] for s in steady),
           "samples_per_s": sum(s["samples"] for s in steady) / seconds, "loop_tokens_per_s_per_gpu": tokens / seconds,
           "loop_tokens_per_s_48_layer_equivalent": tokens / seconds * layers / QWEN3_LAYERS,
           "rollout_tokens_per_s": rate(sum(s["generated_tokens"] for s in steady), sum(s["generation_s"] for s in steady)),
           "trainer_tokens_per_s": rate(tokens, sum(s["train_s"] for s in steady)), "gpu_busy": busy,
           "rollout_host_share": rate(sum(s["rollout_host_s"] for s in steady), sum(s["generation_s"] for s in steady)),
           "rollout_host_ms_per_engine_step": rate(1000 * sum(s["rollout_host_s"] for s in steady),
                                                   sum(s["engine_steps"] for s in steady)),
           "nemo_rl_tokens_per_s_per_gpu": NEMO_RL_TOKENS_PER_GPU}
    if standalone is not None:
        # the first measured step's parts alone: its requests' generation (the same drawn lengths), its training at
        # the trainer's standalone rate; publication and load have no standalone figure and count as measured
        first = steady[0]
        out["standalone_sum_s"] = (standalone["generation_s"] + first["trained_tokens"] / standalone["trainer_tokens_per_s"]
                                   + first["publish_s"] + first["load_s"])
        out["sync_over_standalone"] = first["step_s"] / out["standalone_sum_s"]
        # the same step's samples through each part alone: the rate the slower part sets on separate GPUs
        out["parts_alone_samples_per_s"] = min(first["samples"] / standalone["generation_s"],
                                               standalone["trainer_tokens_per_s"] * first["samples"]
                                               / first["trained_tokens"])
    timed = [d for d in delivered or [] if d["delivery_s"] is not None]
    if timed:  # the slowest version's delivery in trainer steps (<= 1: every version there within a step)
        out["delivery_s_max"] = max(d["delivery_s"] for d in timed)
        out["delivery_over_trainer_step_max"] = max(d["delivery_s"] / d["trainer_step_s"] for d in timed)
    return out


def targets(mode: str, summary: dict, sync: dict | None,
            placement: str = "colocated") -> list[tuple[str, float | None, bool | None]]:
    """(target, measured value, met) for this mode and placement; met is None where the figure is missing."""
    def row(name: str, value: float | None, met) -> tuple[str, float | None, bool | None]:
        return name, value, None if value is None else met(value)

    if placement == "split":
        rows = []
        if mode == "async":
            alone = summary.get("parts_alone_samples_per_s") or (sync or {}).get("parts_alone_samples_per_s")
            rows.append(row(f"async samples/s >= {SPLIT_ASYNC_TARGET} x min(rollout alone, trainer alone)",
                            alone and summary["samples_per_s"] / alone, lambda v: v >= SPLIT_ASYNC_TARGET))
        return rows + [row("every version on the server within the trainer's step time",
                           summary.get("delivery_over_trainer_step_max"), lambda v: v <= 1)]
    rows = []
    if mode == "sync":
        ratio = summary.get("sync_over_standalone")
        rows.append((f"sync step <= {SYNC_OVERHEAD_TARGET} x its parts alone", ratio,
                     None if ratio is None else ratio <= SYNC_OVERHEAD_TARGET))
    else:
        ratio = None if sync is None else summary["samples_per_s"] / sync["samples_per_s"]
        rows.append((f"async samples/s >= {ASYNC_SPEEDUP_TARGET} x sync", ratio,
                     None if ratio is None else ratio >= ASYNC_SPEEDUP_TARGET))
    busy = summary["gpu_busy"]
    rows.append((f"GPU busy >= {BUSY_TARGET:.0%} of 100 ms samples", busy, None if busy is None else busy >= BUSY_TARGET))
    return rows


def table(result: dict) -> str:
    s = result["summary"]
    lines = ["| step | step s | idle s | generation s | load s | score s | train s | publish s | other s | "
             "generated tok | trained tok | staleness |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["steps"]:
        lines.append(f"| {p['step']} | {p['step_s']:.1f} | {p['idle_s']:.1f} | {p['generation_s']:.1f} | "
                     f"{p['load_s']:.1f} | {p['score_s']:.2f} | {p['train_s']:.1f} | {p['publish_s']:.2f} | "
                     f"{p['other_s']:.2f} | {p['generated_tokens']:.0f} | {p['trained_tokens']:.0f} | "
                     f"{p['staleness']:.2f} |")
    alone = result.get("standalone")
    lines.append(f"\n{result['mode']} on {result['layers']} layers, steps {s['steps_measured']}: "
                 f"{s['samples_per_s']:.2f} samples/s; whole loop {s['loop_tokens_per_s_per_gpu']:.0f} tok/s per GPU "
                 f"({s['loop_tokens_per_s_48_layer_equivalent']:.0f} x {result['layers']}/48 layers, beside NeMo-RL's "
                 f"{NEMO_RL_TOKENS_PER_GPU} per H100 for the whole model)")
    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f}"

    lines.append(f"rollout {shown(s['rollout_tokens_per_s'])} tok/s in the loop"
                 + ("" if alone is None else f" vs {alone['rollout_tokens_per_s']:.0f} alone") +
                 f"; trainer {shown(s['trainer_tokens_per_s'])} tok/s in the loop"
                 + ("" if alone is None else f" vs {alone['trainer_tokens_per_s']:.0f} alone"))
    lines += [engine_line(s, alone), gpu_line(s, result.get("nvml_phases") or {}), delivery_line(result)]
    for name, value, met in result["targets"]:
        shown = "not measured" if value is None else f"{value:.2f}"
        lines.append(f"target {name}: {shown} -> {'met' if met else 'not met' if met is not None else 'unknown'}")
    return "\n".join(lines)


def delivery_line(result: dict) -> str:
    """The placement, and each version's way from publication to the server beside the trainer's step."""
    trainer_gpu, rollout_gpu = PLACEMENTS[result["placement"]][0]
    where = "on the CPU" if result["device"] == "cpu" else f"(trainer GPU {trainer_gpu}, rollout GPU {rollout_gpu})"
    parts = [f"v{d['version']} " + ("not served before the run stopped" if d["delivery_s"] is None else
                                    f"{d['delivery_s']:.1f} s") + f" (trainer step {d['trainer_step_s']:.1f} s)"
             for d in result["deliveries"]]
    return (f"placement {result['placement']} {where}; weights "
            f"published -> served: {'; '.join(parts)}")


def fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def engine_line(summary: dict, alone: dict | None) -> str:
    """The rollout engine's host time between the device's forwards, in the loop and alone."""
    ms = summary.get("rollout_host_ms_per_engine_step")
    line = (f"rollout engine: host work {fraction(summary.get('rollout_host_share'))} of its generating time, "
            f"{'n/a' if ms is None else f'{ms:.2f}'} ms per engine step")
    gen = (alone or {}).get("generation") or {}
    if "host_step_ms" in gen:
        line += (f"; alone {gen['host_step_ms']:.2f} ms host + {gen['device_step_ms']:.2f} ms device per decode "
                 f"step")
    return line


def gpu_line(summary: dict, phases: dict) -> str:
    """GPU busy (the issue's share of samples at >= 90 %) beside the mean utilisation, overall and by phase."""
    parts = [f"{phase} {fraction(p['share'])} of samples (busy {fraction(p['busy'])}, mean "
             f"{fraction(p['mean_utilisation'])})" for phase, p in phases.items() if p["samples"]]
    return (f"GPU busy {fraction(summary.get('gpu_busy'))} of samples at >= {BUSY_UTILISATION}%, mean utilisation "
            f"{fraction(summary.get('gpu_util_mean'))}" + (f"; by phase: {'; '.join(parts)}" if parts else ""))


def standalone(args: argparse.Namespace, layers: int, out: Path, timeout_s: float) -> dict | None:
    """The parts alone, in a child process (it holds the GPU alone and frees it when it exits); None when it did
    not finish within `timeout_s` (the loop still runs, its sync target then unknown)."""
    argv = [sys.executable, "-m", "moe_rl_eks.tools.bench.rl_gpu", "--standalone-child", str(out), "--layers",
            str(layers), "--steps", str(args.steps), *args.child_argv]
    try:
        subprocess.run(argv, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"bench-rl --gpu: the standalone parts took over {timeout_s:.0f} s; the loop runs without them",
              file=sys.stderr)
        return None
    return json.loads(out.read_text())


def standalone_child(args: argparse.Namespace, layers: int, out: Path) -> None:
    import torch

    from moe_rl_eks.workloads.model.parallelize import checkpoint_layers
    from moe_rl_eks.workloads.rl.data import RandomTokenSource

    from . import rollout as bench_rollout
    from . import train as bench_train

    device = torch.device("cpu" if args.tiny else "cuda")
    run = parse(RunConfig, run_data(args, layers, out.parent), source="bench-rl --gpu")
    model_cfg = run.model
    # the prompts of the first measured step (the second; a synchronous step k draws the step's groups k-1 x P on)
    groups = args.samples // args.n
    source = RandomTokenSource(run.rl.task, run.rl.training.seed, model_cfg.vocab_size, run.rl.sampling.max_tokens,
                               start=groups if args.steps > 1 else 0)
    lengths = [p.max_tokens for p in (source.next() for _ in range(groups)) for _ in range(args.n)]
    model = bench_rollout.build_model(model_cfg, device, "torch" if args.tiny else "triton")
    gen = bench_rollout.run_engine(model, len(lengths), args.prompt_tokens, args.max_tokens, graphs=not args.tiny,
                                   max_seconds=3600, lengths=lengths, slots=min(args.batch_size, len(lengths)),
                                   look_ahead=args.async_scheduling)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sequence = args.prompt_tokens + args.mean_tokens
    step = bench_train.Step(model_cfg, "torch" if args.tiny else "triton", device)
    checkpoint_layers(step.model, run.rl.training.activation_checkpointing)  # as the loop's trainer recomputes
    trained = bench_train.measure(step, sequence, max(1, args.microbatch_tokens // sequence), 2,
                                  bench_train.dense_peak_tflops(device))
    out.write_text(json.dumps({"generation_s": gen["seconds"], "rollout_tokens_per_s": gen["tokens_per_s"],
                               "generation": gen, "trainer_tokens_per_s": trained["tokens_per_second"],
                               "training": trained}))


def run_mode(args: argparse.Namespace, layers: int, root: Path, deadline: float) -> dict:
    """One mode of the loop, stopped after its --steps-th step; the per-step breakdown."""
    path = root / "run.yaml"
    shutil.rmtree(root / "run", ignore_errors=True)
    path.write_text(yaml.safe_dump(run_data(args, layers, root)))
    run = parse(RunConfig, yaml.safe_load(path.read_text()), source=str(path))
    cluster = LocalCluster(str(path), run)
    gpus = sorted(set(PLACEMENTS[args.placement][0])) if run.local_gpus is not None else [0]
    samplers = {gpu: GpuSampler(gpu) for gpu in gpus}
    counters, times = [], []
    served_at: dict[int, float] = {}  # weight version -> when the server was first seen serving it
    track: list[tuple[float, float]] = []  # (Unix time, the rollout's busy seconds) every PHASE_POLL_S
    next_track = 0.0
    try:
        cluster.start_server(0)
        cluster.start_orchestrator()
        cluster.start_trainer()
        url = cluster.servers[0].url
        while True:
            rows = read_metrics(cluster.out)
            new_row = len(counters) <= len(rows)  # a new step's record (or the start)
            if new_row or time.monotonic() >= next_track:  # read the rollout's counters
                try:
                    sample, now = rollout_counters(url), time.time()  # Unix time, as the GPU samples'
                except OSError:  # the server not up yet
                    if rows:
                        raise
                else:
                    track.append((now, sample["busy_seconds"]))
                    served_at.setdefault(int(sample["weight_version"]), now)
                    next_track = time.monotonic() + PHASE_POLL_S
                    if new_row:
                        # records that appeared within one poll (a tiny model's steps) share the reading: the
                        # rollout's work between them goes to the last
                        counters += [sample] * (len(rows) + 1 - len(counters))
                        times += [now] * (len(counters) - len(times))
            if len(rows) >= args.steps:
                break
            for role in (cluster.trainer, *cluster.servers):
                if role.proc.poll() is not None:
                    raise SystemExit(f"bench-rl --gpu: {role.name} exited with {role.proc.returncode}; see "
                                     f"{cluster.logs}")
            if time.monotonic() > deadline:
                print(f"bench-rl --gpu: {len(rows)} of {args.steps} steps within --timeout {args.timeout:g} s",
                      file=sys.stderr)
                break
            time.sleep(POLL_S)
    finally:
        end = time.time()
        if cluster.trainer is not None:  # SIGKILL: a SIGTERMed trainer would first checkpoint (tens of GB)
            cluster.trainer.stop(signal.SIGKILL)
        cluster.stop()
        for sampler in samplers.values():
            sampler.stop()
        # the run's weight versions and caches (11 GB each at 8 layers): the next mode needs the disk
        for child in cluster.out.iterdir():
            if child.is_dir() and child.name not in ("logs", "tensorboard"):
                shutil.rmtree(child, ignore_errors=True)
    rows = read_metrics(cluster.out)[:min(len(counters) - 1, args.steps)]
    if not rows:
        raise SystemExit(f"bench-rl --gpu: no step finished; see {cluster.logs}")
    start, stop = times[1] if len(times) > 2 else times[0], min(end, times[len(rows)])
    # the GPUs' samples together (split: both roles' GPUs), and each GPU's
    windows = {gpu: sampler.window(start, stop) for gpu, sampler in samplers.items()}
    window = sorted(sample for w in windows.values() for sample in w)
    gpu = utilisation(window)
    return {"steps": breakdown(rows, counters, args.prompt_tokens), "gpu_busy": gpu["busy"],
            "deliveries": deliveries(rows, served_at),
            "nvml_by_gpu": {str(g): utilisation(w) for g, w in windows.items()},
            "gpu_util_mean": gpu["mean_utilisation"], "nvml_samples": gpu["samples"],
            # what ran when each sample was taken, and the samples themselves (seconds from the window's start)
            "nvml_phases": phase_split(window, generating_spans(track), training_spans(rows)),
            "nvml_trace": [[round(t - start, 2), u] for t, u in window]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl bench-rl --gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--staleness", type=int, default=1, help="async: rl.orchestrator.max_staleness")
    parser.add_argument("--steps", type=int, default=3, help="RL steps measured")
    parser.add_argument("--layers", type=int, default=8, help="layers of the Qwen3-30B-A3B shape (fewer if they do "
                        "not fit)")
    parser.add_argument("--samples", type=int, default=512, help="samples per step (groups of --n)")
    parser.add_argument("--n", type=int, default=16, help="GRPO group size")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--mean-tokens", type=int, default=2000, help="mean drawn completion length")
    parser.add_argument("--max-tokens", type=int, default=8192, help="longest drawn completion")
    parser.add_argument("--batch-size", type=int, default=256, help="rollout.max_batch_size (rows decoding at once)")
    parser.add_argument("--microbatch-tokens", type=int, default=16384, help="rl.training.max_tokens_per_microbatch")
    # the trainer's float32 state at 8 layers is ~86 GiB, its activations (full checkpointing, 16k-token micro-
    # batches) ~5.5 GiB, the bf16 export ~10.4 GiB (at 0.70 the trainer ran out of memory at its second step on the
    # H200, 2026-12-02); the rollout's bf16 weights ~10.4 GiB, its in-flight swap's staging and the KV cache the rest
    parser.add_argument("--placement", choices=tuple(PLACEMENTS), default="colocated", help="colocated: both roles "
                        "on GPU 0 by memory shares; split: the trainer on GPU 0, the rollout server on GPU 1")
    parser.add_argument("--trainer-share", type=float, default=None, help="the trainer's memory share of its GPU "
                        "(its float32 state, and colocated the bf16 export of the weights to the server; default "
                        "0.76 colocated, 0.9 split)")
    parser.add_argument("--rollout-share", type=float, default=None, help="the rollout server's memory share "
                        "(default 0.22 colocated, 0.9 split)")
    parser.add_argument("--standalone", action=argparse.BooleanOptionalAction, default=None,
                        help="measure the parts alone first (default: with --mode sync)")
    parser.add_argument("--compare", help="async: the sync run's results.json, for the async target")
    parser.add_argument("--timeout", type=float, default=1800, help="the command's seconds: the loop stops then and "
                        "reports the steps it finished")
    parser.add_argument("--standalone-share", type=float, default=0.45,
                        help="of --timeout, the most the standalone parts may take")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="rollout.async_scheduling (default on, as in a run): the rollout engine queues each "
                        "decode step before booking the previous one's tokens (also alone)")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU (the test of this script)")
    parser.add_argument("--out", default="runs/bench-rl-gpu")
    parser.add_argument("--standalone-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.samples % args.n:
        parser.error(f"--samples {args.samples}: must be a multiple of --n ({args.n})")
    if args.mode == "async" and args.staleness < 1:
        parser.error(f"--staleness {args.staleness}: async needs >= 1 (0 is --mode sync)")
    if args.tiny and args.placement != "colocated":
        parser.error(f"--placement {args.placement}: --tiny runs every role on the CPU")
    shares = PLACEMENTS[args.placement][1]
    args.trainer_share = shares[0] if args.trainer_share is None else args.trainer_share
    args.rollout_share = shares[1] if args.rollout_share is None else args.rollout_share
    # what the standalone child needs to build the same shapes (all but the mode's own flags)
    args.child_argv = [*(["--tiny"] if args.tiny else []),
                       "--async-scheduling" if args.async_scheduling else "--no-async-scheduling",
                       "--samples", str(args.samples), "--n", str(args.n),
                       "--prompt-tokens", str(args.prompt_tokens), "--mean-tokens", str(args.mean_tokens),
                       "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
                       "--microbatch-tokens", str(args.microbatch_tokens)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.standalone_child:
        out = Path(args.standalone_child)
        standalone_child(args, args.layers, out)
        return 0
    name = "sync" if args.mode == "sync" else f"async{args.staleness}"
    root = Path(args.out).resolve() / name
    root.mkdir(parents=True, exist_ok=True)
    # the tiny model keeps its own depth; on a GPU the memory model picks it
    if not args.tiny:
        gpu_bytes = gpu_memory_bytes()
        check_gpus(args, root, len(gpu_bytes))
    layers, why = (TINY_LAYERS, None) if args.tiny else fitting_layers(args, root, gpu_bytes)
    if why:
        print(f"bench-rl --gpu: {args.layers} layers do not fit ({why}); running {layers}", flush=True)
    deadline = time.monotonic() + args.timeout
    alone = None
    if args.standalone if args.standalone is not None else args.mode == "sync":
        alone = standalone(args, layers, root / "standalone.json", args.standalone_share * args.timeout)
    measured = run_mode(args, layers, root, deadline)
    summary = summarize(measured["steps"], layers, alone, measured["gpu_busy"], measured["deliveries"])
    summary["gpu_util_mean"] = measured["gpu_util_mean"]
    sync = json.loads(Path(args.compare).read_text())["summary"] if args.compare else None
    command = "moerl bench-rl --gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"mode": name, "placement": args.placement, "device": "cpu" if args.tiny else "cuda", "layers": layers,
              "layers_asked": args.layers, "why_fewer": why, "command": command,
              "date": time.strftime("%Y-%m-%d"), "standalone": alone, "summary": summary, "steps": measured["steps"],
              "nvml_samples": measured["nvml_samples"], "nvml_phases": measured["nvml_phases"],
              "deliveries": measured["deliveries"], "nvml_by_gpu": measured["nvml_by_gpu"],
              "targets": targets(args.mode, summary, sync, args.placement), "nvml_trace": measured["nvml_trace"]}
    (root / "results.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    print(text)
    (root / "results.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
