"""`moerl local-run`: the whole loop on this machine, as separate processes exactly as on EKS: N rollout servers
(`moerl serve-rollout`), the orchestrator (`moerl orchestrate`) and the trainer (`torchrun ... moerl train`, EP
over gloo). Shows a progress bar, then evaluates the initial, post-warm-up and final weights on freshly
sampled prompts, writes a reward-curve PNG and prints the summary."""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args, get_type_hints

import yaml

from moe_rl_eks.core.launch import launch
from moe_rl_eks.core.rl_config import AlgorithmConfig
from moe_rl_eks.core.run import LOCAL_RANKS, RunConfig, check_local_gpus, check_local_machine
from moe_rl_eks.core.schema import parse
from moe_rl_eks.workloads.rl.runtime import load, output_dir, read_jsonl, run_argparser, wait_for

CLI = [sys.executable, "-m", "moe_rl_eks.tools.cli"]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Role:
    name: str
    proc: subprocess.Popen
    url: str | None = None

    def send(self, sig: int) -> None:
        """Signal the role's process group and every descendant's: torchrun starts its workers in sessions of
        their own, so a SIGKILL of torchrun's group alone would leave them training."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.killpg(os.getpgid(pid), sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Signal the role and wait; SIGKILL if it does not go."""
        if self.proc.poll() is None:
            self.send(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class LocalCluster:
    """Starts and stops the roles of a local run; tests use it to kill and restart them."""

    def __init__(self, run_path: str, run: RunConfig, env: dict | None = None) -> None:
        if run.local_gpus is not None:  # every starter of roles (local-run, the benchmarks, tests) checks here
            check_local_gpus(run, gpu_count(), source=run_path)
        self.run_path, self.run = run_path, run
        self.out = output_dir(run)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    run.rl.weight_token_env: secrets.token_hex(16), **(env or {})}
        self.servers: list[Role] = []
        self.orchestrator: Role | None = None
        self.trainer: Role | None = None

    def _spawn(self, name: str, argv: list[str], cpus: set[int] | None = None,
               gpus: tuple[int, ...] | None = None) -> subprocess.Popen:
        """Start a role in its own session; `cpus` pins it (and its children) to those cores, `gpus` shows it only
        those GPUs (as its devices 0..n-1)."""
        log = open(self.logs / f"{name}.log", "a")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        env = self.env if gpus is None else {**self.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=pin)

    def start_server(self, index: int, cpus: set[int] | None = None) -> Role:
        """Start rollout server `index`; a restarted one takes its predecessor's port, so the orchestrator's
        endpoint list still names it."""
        port = int(self.servers[index].url.rsplit(":", 1)[1]) if index < len(self.servers) else free_port()
        argv = launch(CLI + ["serve-rollout", "--run", self.run_path, "--host", "127.0.0.1", "--port", str(port)],
                      processes=self.run.rollout.gpus_per_server, torchrun=TORCHRUN)
        gpus = self.run.server_gpus(index) if self.run.local_gpus is not None else None
        proc = self._spawn(f"rollout-{index}", argv, cpus, gpus)
        role = Role(f"rollout-{index}", proc, f"http://127.0.0.1:{port}")
        if index < len(self.servers):
            self.servers[index] = role
        else:
            self.servers.append(role)
        return role

    def start_orchestrator(self, resume: bool = False, cpus: set[int] | None = None) -> Role:
        """Start the orchestrator; a restarted one takes its predecessor's port, so the trainer's --orchestrator
        still names it (as a Service's name would on a cluster)."""
        port = int(self.orchestrator.url.rsplit(":", 1)[1]) if self.orchestrator is not None else free_port()
        argv = CLI + ["orchestrate", "--run", self.run_path, "--host", "127.0.0.1", "--port", str(port)]
        for s in self.servers:
            argv += ["--endpoint", s.url]
        if resume:  # from the run's newest trainer checkpoint, if any
            argv += ["--resume", "latest"]
        self.orchestrator = Role("orchestrator", self._spawn("orchestrator", argv, cpus), f"http://127.0.0.1:{port}")
        wait_for(f"{self.orchestrator.url}/health", timeout=START_TIMEOUT_S)
        return self.orchestrator

    def start_trainer(self, cpus: set[int] | None = None) -> Role:
        gpus = self.run.local_gpus.trainer.gpus if self.run.local_gpus is not None else None
        ranks = len(gpus) if gpus else self.run.parallelism.ranks_per_node or LOCAL_RANKS
        # The agent checks its workers every second, not every 0.1 s (its default): it shares a core with a role.
        argv = [*TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", "--monitor-interval=1",
                # "--": without it torchrun takes `--run` for an abbreviation of its own `--run-path`.
                "-m", "--", "moe_rl_eks.tools.cli", "train", "--run", self.run_path, "--orchestrator", self.orchestrator.url,
                "--metrics-port", str(free_port())]
        self.trainer = Role("trainer", self._spawn("trainer", argv, cpus, gpus))
        return self.trainer

    def start(self) -> None:
        for i in range(self.run.rollout.min_servers):
            self.start_server(i)
        self.start_orchestrator()
        self.start_trainer()

    def stop(self) -> None:
        for role in [self.trainer, self.orchestrator, *self.servers]:
            if role is not None:
                role.stop()


def read_metrics(out: Path) -> list[dict]:
    """metrics.jsonl, the last record of each step (a resumed trainer re-runs steps after its checkpoint)."""
    rows = {}
    for row in read_jsonl(out / "metrics.jsonl"):
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def progress_line(row: dict, total: int) -> str:
    done = int(30 * row["step"] / total)
    return (f"\r[{'#' * done}{'.' * (30 - done)}] step {row['step']}/{total}  reward {row['reward_mean']:.3f}  "
            f"acc {row['accuracy']:.2f}  {row['samples_per_second']:.1f} samples/s  "
            f"staleness {row['staleness_mean']:.2f}  idle {row['trainer_idle_fraction']:.2f}")


def watch(cluster: LocalCluster, timeout_s: float) -> int:
    """Print progress until the trainer exits; returns its exit code."""
    deadline = time.monotonic() + timeout_s
    total = cluster.run.rl.training.steps
    shown = None
    while cluster.trainer.proc.poll() is None:
        rows = read_metrics(cluster.out)
        if rows and rows[-1]["step"] != shown:
            shown = rows[-1]["step"]
            print(progress_line(rows[-1], total), end="", flush=True)
        if time.monotonic() > deadline:
            print(f"\nlocal-run: no finish within {timeout_s:.0f} s; stopping", file=sys.stderr)
            cluster.trainer.stop()
            return 124
        for s in cluster.servers:
            if s.proc.poll() is not None:
                print(f"\nlocal-run: {s.name} exited with {s.proc.returncode}; see {cluster.logs}", file=sys.stderr)
        time.sleep(1)
    print()
    return cluster.trainer.proc.returncode


def evaluate(run: RunConfig, directories: dict[str, Path]) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """rl.evaluation's metrics (eval/...) of the weights in each directory on the run's evaluation prompts: a
    dataset's evaluation split, or built-in problems drawn with their own seed (not held out from training for the
    arithmetic task, whose small problem space training covers; the countdown task's space is large), with
    reward_mean and accuracy (pass@1) for the summary and the plot; and each prompt's mean reward, paired across
    the directories. One set of reward workers scores them all."""
    from moe_rl_eks.tools.evaluate import CheckpointEvaluator

    with CheckpointEvaluator(run) as evaluator:
        scored = {name: evaluator.scored(directory) for name, directory in directories.items()}
    evals = {name: {"reward_mean": m["eval/reward_mean"], "accuracy": m["eval/pass@1"], **m}
             for name, (m, _) in scored.items()}
    return evals, {name: rewards for name, (_, rewards) in scored.items()}


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """The mean per-prompt reward gain from `before` to `after` (the same prompts) and its standard error."""
    diffs = [b - a for a, b in zip(before, after) if not (math.isnan(a) or math.isnan(b))]
    if len(diffs) < 2:
        return math.nan, math.nan
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def final_weights(run: RunConfig, out: Path) -> Path:
    """The directory of the run's newest published version (the store's LATEST)."""
    from moe_rl_eks.workloads.rl.weights import open_store

    store = open_store(run.rl.weights, out / "weights")
    return store.fetch(store.latest(), out / "weights-cache")


def plot(rows: list[dict], evals: dict[str, dict], path: Path) -> None:
    import matplotlib

    from moe_rl_eks.workloads.orchestrator.evaluation import read_records

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label="batch mean reward")
    ax.plot([r["step"] for r in rows], [r["accuracy"] for r in rows], label="batch accuracy", alpha=0.6)
    periodic = read_records(path.parent)  # every rl.evaluation.every_steps, when the run evaluates periodically
    if periodic:
        ax.plot([r["step"] for r in periodic], [r["eval/reward_mean"] for r in periodic], marker=".",
                label="evaluation reward")
    for name, marker in (("initial", "x"), ("warmup", "o"), ("final", "s")):
        if name in evals:
            x = rows[-1]["step"] if name == "final" and rows else 0
            ax.scatter([x], [evals[name]["reward_mean"]], marker=marker, label=f"evaluation reward ({name})")
    ax.set_xlabel("RL step (weight version)")
    ax.set_ylabel("reward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gpu_count() -> int:
    """The CUDA devices this process sees (0 without CUDA); NVML's count, so the caller's CUDA stays uninitialised."""
    import torch

    return torch.cuda.device_count()


def gpu_memory_bytes() -> list[int]:
    """The memory of each GPU this process sees (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def placement(run: RunConfig) -> str:
    local = run.local_gpus
    if local is None:
        return (f"{run.rollout.min_servers} rollout servers, trainer EP={run.parallelism.ranks_per_node or LOCAL_RANKS}"
                " (gloo) on the CPU")
    return (f"{run.rollout.min_servers} rollout server(s) on GPU {list(local.rollout.gpus)} "
            f"({local.rollout.memory_share:.0%} of memory each), trainer on GPU {list(local.trainer.gpus)} "
            f"({local.trainer.memory_share:.0%}, NCCL)")


def quick_data(path: str, run: RunConfig) -> dict:
    """The data of the run file at `path` (loaded as `run`) with a quarter of its RL steps, warm-up steps and
    evaluation prompts (at least one)."""
    data = yaml.safe_load(Path(path).read_text())
    rl = data.setdefault("rl", {})
    training, evaluation = rl.setdefault("training", {}), rl.setdefault("evaluation", {})
    for section, name, value in ((training, "steps", run.rl.training.steps),
                                 (training, "warmup_sft_steps", run.rl.training.warmup_sft_steps),
                                 (evaluation, "prompts", run.rl.evaluation.prompts)):
        section[name] = max(1, value // 4) if value else 0
    training["checkpoint_every"] = max(1, min(run.rl.training.checkpoint_every, training["steps"]))
    return data


# The settings the numerics A/B varies (docs/benchmarks.md), as the command line may override them
CORRECTIONS = get_args(get_type_hints(AlgorithmConfig)["importance_correction"])


def variant_data(data: dict, numerics: str | None = None, importance_correction: str | None = None,
                 max_staleness: int | None = None) -> dict:
    """Run file data with the numerics A/B's settings overridden where given, named after them, so each arm has its
    own output directory: <name>-exact (numerics: exact), -correction-<value> (rl.algorithm.importance_correction),
    -staleness<N> (rl.orchestrator.max_staleness)."""
    data, name = {**data, "rl": dict(data.get("rl", {}))}, data["name"]
    rl = data["rl"]
    if numerics is not None:
        data["numerics"] = numerics
        name += "-exact" if numerics == "exact" else ""
    if importance_correction is not None:
        rl["algorithm"] = {**rl.get("algorithm", {}), "importance_correction": importance_correction}
        name += f"-correction-{importance_correction}"
    if max_staleness is not None:
        rl["orchestrator"] = {**rl.get("orchestrator", {}), "max_staleness": max_staleness}
        name += f"-staleness{max_staleness}"
    return {**data, "name": name}


# What each RL step reports of the rollout/trainer mismatch (trainer/numerics.MismatchTally) and of the
# off-policy correction (rl/losses.py): the A/B's columns, averaged over the run's steps in summary.json
MISMATCH_MEANS = ("logprob_bitwise_equal", "logprob_abs_diff_mean", "logprob_kl_rollout_trainer",
                  "logprob_kl_trainer_rollout", "importance_weight_mean", "importance_truncated_fraction")


def mismatch_summary(rows: list[dict]) -> dict[str, float]:
    """The per-step means of MISMATCH_MEANS over the RL steps' metrics rows that have them (PPO's critic warm-up
    steps report no importance weights), and the largest |d log p| of any."""
    summary = {key: statistics.fmean(values) for key in MISMATCH_MEANS
               if (values := [r[key] for r in rows if key in r])}
    if rows:
        summary["logprob_abs_diff_max"] = max(r["logprob_abs_diff_max"] for r in rows)
    return summary


def argparser():
    parser = run_argparser("local-run", "run the whole RL loop on this machine")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of the run")
    parser.add_argument("--timeout", type=float, default=1200, help="stop the run after this many seconds")
    parser.add_argument("--quick", action="store_true", help="a short form of the run: a quarter of its RL and "
                        "warm-up steps and of its evaluation prompts")
    parser.add_argument("--numerics", choices=("standard", "exact"), default=None,
                        help="run in this numerics mode instead of the run file's (the exact-numerics A/B); "
                        "exact runs under the name <name>-exact, so both runs' outputs stay")
    parser.add_argument("--importance-correction", choices=CORRECTIONS, default=None,
                        help="rl.algorithm.importance_correction instead of the run file's (the A/B's arms); "
                        "runs under <name>-correction-<value>")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="rl.orchestrator.max_staleness instead of the run file's (0: synchronous, the A/B's "
                        "on-policy setting); runs under <name>-staleness<N>")
    return parser


def variant_overrides(args) -> dict:
    """The parsed command line's overrides for variant_data (None: the run file's)."""
    return {"numerics": args.numerics, "importance_correction": args.importance_correction,
            "max_staleness": args.max_staleness}


def main(argv: list[str]) -> int:
    args = argparser().parse_args(argv)
    run_path, run = args.run, load(args.run)
    derived = None  # the roles read a derived run file, written beside the run's outputs
    if args.quick:
        derived = quick_data(args.run, run)
    overrides = variant_overrides(args)
    if any(v is not None for v in overrides.values()):
        derived = variant_data(derived or yaml.safe_load(Path(args.run).read_text()), **overrides)
    if derived is not None:
        flags = " ".join(["--quick"] * args.quick + [f"--{k.replace('_', '-')} {v}" for k, v in overrides.items()
                                                     if v is not None])
        run = parse(RunConfig, derived, source=f"{args.run} ({flags})")
        run_path = str(output_dir(run).parent / f"{run.name}{'-quick' if args.quick else ''}.yaml")
    if run.local_gpus is not None:
        check_local_machine(run, gpu_memory_bytes(), source=args.run)  # before any role starts or any file goes
    out = output_dir(run)
    if not args.resume and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if derived is not None:
        Path(run_path).write_text(yaml.safe_dump(derived))
    cluster = LocalCluster(run_path, run)
    print(f"local-run {run.name}: {placement(run)}, max_staleness {run.rl.orchestrator.max_staleness}; "
          f"logs in {cluster.logs}", flush=True)
    start = time.monotonic()
    try:
        for i in range(run.rollout.min_servers):
            cluster.start_server(i)
        cluster.start_orchestrator(resume=args.resume)
        cluster.start_trainer()
        rc = watch(cluster, args.timeout)
    finally:
        cluster.stop()
    if rc != 0:
        print(f"local-run: trainer exited with {rc}; see {cluster.logs / 'trainer.log'}", file=sys.stderr)
        return rc
    rows = read_metrics(out)
    points = {name: out / "eval" / name for name in ("initial", "warmup") if (out / "eval" / name).exists()}
    evals, prompt_rewards = evaluate(run, {**points, "final": final_weights(run, out)})
    plot(rows, evals, out / "reward_curve.png")
    gain, gain_se = paired_gain(prompt_rewards.get("warmup", prompt_rewards["final"]), prompt_rewards["final"])
    summary = {"seconds": time.monotonic() - start, "steps": len(rows), "evaluation": evals,
               "rl_gain": evals["final"]["reward_mean"] - evals.get("warmup", evals["final"])["reward_mean"],
               "rl_gain_paired_se": gain_se, "rl_gain_in_paired_se": gain / gain_se if gain_se else math.nan,
               "samples_per_second": rows[-1]["samples_per_second"] if rows else 0.0,
               "trainer_idle_fraction": rows[-1]["trainer_idle_fraction"] if rows else 0.0,
               # the A/B's record: what this arm ran with, and the mismatch it trained on
               "settings": {"numerics": run.numerics, "importance_correction": run.rl.algorithm.importance_correction,
                            "importance_cap": run.rl.algorithm.importance_cap,
                            "max_staleness": run.rl.orchestrator.max_staleness, "seed": run.rl.training.seed},
               "mismatch": mismatch_summary(rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("evaluation mean reward (accuracy):  " + "  ".join(
        f"{k} {v['reward_mean']:.3f} ({v['accuracy']:.2f})" for k, v in evals.items()))
    print(f"RL gain over post-warm-up: {summary['rl_gain']:+.3f} ({summary['rl_gain_in_paired_se']:.1f} paired "
          f"standard errors over {len(prompt_rewards['final'])} prompts); {summary['samples_per_second']:.1f} samples/s; "
          f"{summary['seconds']:.0f} s; metrics {out / 'metrics.jsonl'}, TensorBoard {out / 'tensorboard'}, "
          f"curve {out / 'reward_curve.png'}, checkpoints {out / 'checkpoints'}")
    return 0
