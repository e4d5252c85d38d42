"""`moerl bench-rl`: the same local job synchronous (max_staleness 0) and asynchronous, for several seeds, the
two modes interleaved (seed 0 sync then async, seed 1 async then sync, ...) so that the machine's load drifts over
both alike. By default (`--layout split`) every run has one rollout server, the orchestrator and the trainer's
launcher on one core and the trainer's worker alone on the other, so the two modes differ in overlap only;
`--layout shared` runs two rollout servers and two trainer ranks placed by the OS (each synchronous phase may use
both cores).

Prints per run: samples/s, trainer idle, rollout idle, mean staleness, final evaluation reward, wall time; then
the goal: when the asynchronous runs' mean evaluation curve first reaches the synchronous runs' mean final
evaluation reward, as a fraction of the synchronous runs' mean wall time (and the same per seed pair). Plots
evaluation reward against wall-clock time for every run and both modes' means. Every `--eval-every`-th published
version is evaluated after its run (so the evaluation takes no time from it), placed at the wall time its step
finished.

`--chaos`: four rollout servers, undisturbed and then with one SIGKILLed every `--kill-every` seconds and
restarted: samples/s of both and their ratio.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import time
from pathlib import Path

import yaml

from ..local_run import LocalCluster, descendants, read_metrics
from moe_rl_eks.workloads.rl.runtime import load

from .rollout_counters import rollout_counters

SHARED_CPU, TRAINER_CPU = 0, 1  # rollout server + orchestrator + torchrun's launcher; the trainer's worker
GOAL_FRACTION = 0.6  # the asynchronous runs should reach the synchronous final reward within this share of its time


def run_file(base: dict, name: str, root: Path, **changes) -> Path:
    """`base` (a run file's mapping) named `name`, writing under root/name, with rl sections updated."""
    data = json.loads(json.dumps(base))
    data["name"] = f"bench-{name}"
    for section, values in changes.items():
        target = data if section in ("parallelism", "rollout") else data["rl"]
        target.setdefault(section, {}).update(values)
    data["rl"].setdefault("training", {})["output_dir"] = str(root / name)
    shutil.rmtree(root / name, ignore_errors=True)  # a fresh run, not a resume of the last benchmark
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def last_step(out: Path) -> int:
    """The step of metrics.jsonl's last record (read from the end: polled while a run goes)."""
    with open(out / "metrics.jsonl", "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        lines = f.read().split(b"\n")[:-1]  # what follows the last newline is a record being written
    return json.loads(lines[-1])["step"] if lines else 0


def move_launcher(cluster: LocalCluster, cpu: int, timeout_s: float = 120) -> None:
    """Once torchrun has started its worker (which keeps the trainer's core it inherited), move torchrun's own
    threads (its agent polls the worker) to `cpu`, so the worker has its core to itself."""
    deadline = time.monotonic() + timeout_s
    while not descendants(cluster.trainer.proc.pid):
        if cluster.trainer.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"torchrun started no worker; see {cluster.logs}")
        time.sleep(0.05)
    for task in Path(f"/proc/{cluster.trainer.proc.pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {cpu})


LAYOUTS = {
    # one rollout server (with the orchestrator and torchrun's launcher) on one core, one trainer rank on the
    # other: the deployment's split of roles onto their own hardware, each role one process of one thread
    "split": {"servers": 1, "ranks": 1, "pinned": True},
    # two rollout servers and two trainer ranks (EP=2 over gloo), placed by the OS: in synchronous mode each phase
    # can use both cores (a colocated baseline, which the EKS deployment's separate pools do not have)
    "shared": {"servers": 2, "ranks": 2, "pinned": False},
}


def bench_run(base: dict, mode: str, max_staleness: int, steps: int, eval_every: int, root: Path,
              seed: int = 0, layout: str = "split") -> dict:
    name = f"{mode}-seed{seed}" + ("" if layout == "split" else f"-{layout}")
    shape = LAYOUTS[layout]
    parallelism = ({"ep_backend": "local", "ranks_per_node": 1} if shape["ranks"] == 1
                   else {"ep_backend": "alltoall", "ranks_per_node": shape["ranks"]})
    path = run_file(base, name, root, parallelism=parallelism,
                    rollout={"min_servers": shape["servers"], "max_servers": shape["servers"]},
                    orchestrator={"max_staleness": max_staleness},
                    training={"steps": steps, "checkpoint_every": steps, "seed": seed},
                    weights={"keep_versions": steps + 1})  # every version stays, for the evaluation afterwards
    run = load(str(path))
    cluster = LocalCluster(str(path), run)
    load_before = os.getloadavg()[0]
    shared_cpus, trainer_cpus = ({SHARED_CPU}, {TRAINER_CPU}) if shape["pinned"] else (None, None)
    try:
        for i in range(shape["servers"]):
            cluster.start_server(i, cpus=shared_cpus)
        cluster.start_orchestrator(cpus=shared_cpus)
        cluster.start_trainer(cpus=trainer_cpus)
        if shape["pinned"]:
            move_launcher(cluster, SHARED_CPU)
        # Measure from the first RL step (after start-up and warm-up) to the last.
        while not read_metrics(cluster.out):
            if cluster.trainer.proc.poll() is not None:
                raise RuntimeError(f"{name}: trainer exited early; see {cluster.logs}")
            time.sleep(0.05)
        first = read_metrics(cluster.out)[0]
        # CPU time of the trainer's workers and of the other roles' processes over the window: what each side
        # had to do, independent of how long other jobs on this machine kept it waiting.
        workers = descendants(cluster.trainer.proc.pid)
        roles = [s.proc.pid for s in cluster.servers] + [cluster.orchestrator.proc.pid]
        others = [*roles, *(c for pid in roles for c in descendants(pid)), cluster.trainer.proc.pid]

        def sample() -> tuple[float, float, float, float]:
            return (sum(rollout_counters(s.url)["busy_seconds"] for s in cluster.servers), time.monotonic(),
                    sum(map(cpu_seconds, workers)), sum(map(cpu_seconds, others)))

        start = sample()
        while cluster.trainer.proc.poll() is None and last_step(cluster.out) < steps:
            time.sleep(0.05)
        end = sample()  # at the last step, before the workers checkpoint and exit
        cluster.trainer.proc.wait(timeout=3600)
    finally:
        cluster.stop()
    load_after = os.getloadavg()[0]
    rows = read_metrics(cluster.out)
    last = rows[-1]
    wall = last["wall_seconds"] - first["wall_seconds"]
    waited = (last["trainer_idle_fraction"] * last["wall_seconds"] - first["trainer_idle_fraction"] * first["wall_seconds"])
    curve = evaluation_curve(run, cluster.out, rows, first["wall_seconds"] - first["step_seconds"], eval_every)
    busy, seconds, trainer_cpu, shared_cpu = (b - a for a, b in zip(start, end))
    return {"mode": mode, "seed": seed, "layout": layout, "max_staleness": max_staleness, "steps": len(rows),
            "samples_per_second": sum(r["samples"] for r in rows[1:]) / wall,
            "trainer_idle_fraction": waited / wall,
            "rollout_idle_fraction": 1 - busy / (seconds * shape["servers"]),
            "mean_staleness": sum(r["staleness_mean"] for r in rows) / len(rows),
            "dropped_stale_groups": last["dropped_stale_groups"],  # generated, then too old to train
            # the off-policy correction at work: tokens whose importance weight pi/pi_behaviour hit the cap
            "importance_truncated_fraction": statistics.fmean(r["importance_truncated_fraction"] for r in rows),
            # a blow-up: the policy leaves the answer format within a step or two (KL to the reference ~5-6)
            "max_kl": max(r.get("kl", 0.0) for r in rows),
            "trainer_cpu_per_step": trainer_cpu / (len(rows) - 1),
            "shared_cpu_per_step": shared_cpu / (len(rows) - 1),
            "final_reward": curve[-1]["reward"], "wall_seconds": curve[-1]["seconds"],
            "load_average": [round(load_before, 2), round(load_after, 2)], "curve": curve}


def evaluation_curve(run, out: Path, rows: list[dict], origin: float, every: int) -> list[dict]:
    """Evaluation reward of versions 0, every, 2 x every, ..., and the last (`target`), each at the wall time
    (seconds from the start of the first RL step) its step finished."""
    from moe_rl_eks.tools.evaluate import CheckpointEvaluator
    from moe_rl_eks.workloads.rl.weights import IncompleteVersion, open_store

    store = open_store(run.rl.weights, out / "weights")
    latest = store.latest()
    finished = {r["step"]: r["wall_seconds"] - origin for r in rows}
    finished[0] = 0.0
    curve = []
    with CheckpointEvaluator(run) as evaluate:
        for target in sorted({*range(0, latest.version + 1, every), latest.version}):
            # The background publisher may skip a version a newer one superseded: take the next one published.
            for v in range(target, latest.version + 1):
                try:
                    directory = store.fetch(v, out / "weights-cache")
                except (FileNotFoundError, IncompleteVersion):
                    continue
                if not curve or curve[-1]["version"] != v:
                    reward = evaluate(directory)["eval/reward_mean"]
                    curve.append({"target": target, "version": v, "seconds": finished[v], "reward": reward})
                break
    return curve


def time_to_reach(curve: list[dict], reward: float) -> float | None:
    """Wall seconds until a curve first reaches `reward` (at an evaluated point); None if it never does."""
    return next((p["seconds"] for p in curve if p["reward"] >= reward), None)


HOLD_MARGIN = 0.05  # a level holds while the curve stays within this of it after first reaching it


def first_crossing(curve: list[dict], reward: float) -> dict:
    """When a curve first reaches `reward` and whether it holds there afterwards (never more than HOLD_MARGIN
    below it at a later evaluated point)."""
    index = next((i for i, p in enumerate(curve) if p["reward"] >= reward), None)
    if index is None:
        return {"seconds": None, "holds": False}
    return {"seconds": curve[index]["seconds"],
            "holds": all(p["reward"] >= reward - HOLD_MARGIN for p in curve[index + 1:])}


def like_for_like(curves: dict[str, list[dict]], levels: list[float]) -> list[dict]:
    """Time-to-reward like for like: at each reward level, each mode's mean curve's first crossing of it (and
    whether it holds), and async's time over sync's; the synchronous run's end is not the yardstick."""
    rows = []
    for level in levels:
        sync, asyn = first_crossing(curves["sync"], level), first_crossing(curves["async"], level)
        ratio = asyn["seconds"] / sync["seconds"] if asyn["seconds"] is not None and sync["seconds"] else None
        rows.append({"reward": level, "sync": sync, "async": asyn, "ratio": ratio})
    return rows


def mean_curve(runs: list[dict]) -> list[dict]:
    """The runs' evaluation curves averaged point by point (reward and wall time), over the evaluation targets
    every run has."""
    targets = sorted(set.intersection(*({p["target"] for p in r["curve"]} for r in runs)))
    by_run = [{p["target"]: p for p in r["curve"]} for r in runs]
    return [{"target": t, "seconds": statistics.fmean(c[t]["seconds"] for c in by_run),
             "reward": statistics.fmean(c[t]["reward"] for c in by_run)} for t in targets]


def summarize(results: list[dict]) -> dict:
    """The goal's figures: the synchronous runs' mean final reward and wall time, when the asynchronous runs'
    mean curve first reaches that reward (and that time over the synchronous mean wall), the same per seed pair,
    the modes' mean throughput and idle fractions, and each mode's mean curve (`curves`)."""
    modes = {m: [r for r in results if r["mode"] == m] for m in ("sync", "async")}
    if not modes["sync"] or not modes["async"]:
        raise ValueError("summarize: needs at least one sync and one async run")
    curves = {m: mean_curve(runs) for m, runs in modes.items()}
    target = statistics.fmean(r["final_reward"] for r in modes["sync"])
    sync_wall = statistics.fmean(r["wall_seconds"] for r in modes["sync"])
    reached = time_to_reach(curves["async"], target)
    pairs = []
    for s in modes["sync"]:
        a = next((r for r in modes["async"] if r["seed"] == s["seed"]), None)
        if a is not None:
            t = time_to_reach(a["curve"], s["final_reward"])
            # learning per sample: async minus sync evaluation reward at the same versions
            mine, theirs = {p["target"]: p["reward"] for p in a["curve"]}, {p["target"]: p["reward"] for p in s["curve"]}
            gaps = [mine[k] - theirs[k] for k in sorted(set(mine) & set(theirs))]
            pairs.append({"seed": s["seed"], "sync_final_reward": s["final_reward"], "sync_wall_seconds": s["wall_seconds"],
                          "async_seconds": t, "fraction": None if t is None else t / s["wall_seconds"],
                          "reward_gap_per_version": statistics.fmean(gaps),
                          "reward_gap_last_quarter": statistics.fmean(gaps[-max(1, len(gaps) // 4):])})
    mean = {m: {k: statistics.fmean(r[k] for r in runs) for k in
                ("samples_per_second", "trainer_idle_fraction", "rollout_idle_fraction", "mean_staleness",
                 "final_reward", "max_kl", "wall_seconds", "trainer_cpu_per_step", "shared_cpu_per_step")}
            for m, runs in modes.items()}
    # Along the way: for the sync mean curve's reward at each quarter of the run, when each mode's mean curve
    # first reached it (how much sooner async gets to the same reward, not only to the final one).
    sync_curve, async_curve = curves["sync"], curves["async"]
    levels = []
    for quarter in (1, 2, 3, 4):
        point = sync_curve[round(quarter * (len(sync_curve) - 1) / 4)]
        t_sync, t_async = time_to_reach(sync_curve, point["reward"]), time_to_reach(async_curve, point["reward"])
        levels.append({"target": point["target"], "reward": point["reward"], "sync_seconds": t_sync,
                       "async_seconds": t_async,
                       "ratio": None if t_async is None or not t_sync else t_async / t_sync})
    # The headline: each mode's first crossing of the same levels (the sync mean curve's at each quarter, its final
    # reward last), not async's first crossing over sync's end.
    same = like_for_like(curves, [x["reward"] for x in levels[:3]] + [target])
    return {"sync_final_reward": target, "sync_wall_seconds": sync_wall, "async_seconds": reached, "levels": levels,
            "like_for_like": same,
            "fraction": None if reached is None else reached / sync_wall,
            "throughput_ratio": mean["async"]["samples_per_second"] / mean["sync"]["samples_per_second"],
            "pairs": pairs, "mean": mean, "curves": curves}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(results)
    colours = {"sync": "tab:blue", "async": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot([p["seconds"] for p in r["curve"]], [p["reward"] for p in r["curve"]], color=colours[r["mode"]],
                alpha=0.3, linewidth=1)
    for mode, curve in summary["curves"].items():
        runs = [r for r in results if r["mode"] == mode]
        ax.plot([p["seconds"] for p in curve], [p["reward"] for p in curve], color=colours[mode], linewidth=2.5,
                label=f"{mode} (max_staleness {runs[0]['max_staleness']}), mean of {len(runs)} seeds")
    ax.axhline(summary["sync_final_reward"], color="grey", linestyle="--", linewidth=1,
               label=f"sync mean final reward {summary['sync_final_reward']:.3f}")
    ax.axvline(GOAL_FRACTION * summary["sync_wall_seconds"], color="grey", linestyle=":", linewidth=1,
               label=f"{GOAL_FRACTION:.0%} of sync mean wall time")
    ax.set_xlabel("wall-clock seconds from the first RL step (CPU, this machine)")
    ax.set_ylabel("evaluation mean reward")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _seconds(crossing: dict) -> str:
    if crossing["seconds"] is None:
        return "never"
    return f"{crossing['seconds']:.0f} s" + ("" if crossing["holds"] else " (does not hold)")


def _fraction(seconds: float | None, wall: float) -> str:
    return "never" if seconds is None else f"{seconds:.0f} s = {seconds / wall:.0%}"


def table(results: list[dict]) -> str:
    lines = ["| seed | mode | max_staleness | steps | samples/s | trainer idle | rollout idle | mean staleness | "
             "final eval reward | max KL | wall s | CPU s/step: trainer, shared core | load avg (start, end) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['mode']} | {r['max_staleness']} | {r['steps']} | {r['samples_per_second']:.1f} | "
                     f"{r['trainer_idle_fraction']:.2f} | {r['rollout_idle_fraction']:.2f} | "
                     f"{r['mean_staleness']:.2f} | {r['final_reward']:.3f} | {r['max_kl']:.2f} | {r['wall_seconds']:.0f} | "
                     f"{r['trainer_cpu_per_step']:.3f}, {r['shared_cpu_per_step']:.3f} | "
                     f"{r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} |")
    s = summarize(results)
    for mode, m in s["mean"].items():
        lines.append(f"| mean | {mode} | | | {m['samples_per_second']:.1f} | {m['trainer_idle_fraction']:.2f} | "
                     f"{m['rollout_idle_fraction']:.2f} | {m['mean_staleness']:.2f} | {m['final_reward']:.3f} | {m['max_kl']:.2f} | "
                     f"{m['wall_seconds']:.0f} | {m['trainer_cpu_per_step']:.3f}, {m['shared_cpu_per_step']:.3f} | |")
    lines.append(f"\nasync / sync throughput (means): {s['throughput_ratio']:.2f}x")
    lines.append(f"async mean curve reached the sync runs' mean final evaluation reward {s['sync_final_reward']:.3f}: "
                 f"{_fraction(s['async_seconds'], s['sync_wall_seconds'])} (sync's mean wall time "
                 f"{s['sync_wall_seconds']:.0f} s; goal <= {GOAL_FRACTION:.0%})")
    lines.append("like for like, each mode's mean curve first at the same reward (holds: stays within "
                 f"{HOLD_MARGIN} of it after): " + "; ".join(
                     f"{x['reward']:.3f}: sync {_seconds(x['sync'])}, async {_seconds(x['async'])}"
                     + ("" if x["ratio"] is None else f" = {x['ratio']:.2f}x") for x in s["like_for_like"]))
    lines.append("sync mean curve's reward at versions " + ", ".join(
        f"{x['target']} ({x['reward']:.3f}): async first at " +
        ("never" if x["async_seconds"] is None else f"{x['async_seconds']:.0f} s") +
        f" vs sync {x['sync_seconds']:.0f} s" for x in s["levels"]))
    lines.append("per seed pair (async reaching its pair's sync final reward, over that sync run's wall time): " +
                 "; ".join(f"seed {p['seed']}: {p['sync_final_reward']:.3f}, "
                           f"{_fraction(p['async_seconds'], p['sync_wall_seconds'])}" for p in s["pairs"]))
    lines.append("async minus sync evaluation reward at the same versions (learning per sample), mean over "
                 "versions / over the last quarter: " + "; ".join(
                     f"seed {p['seed']}: {p['reward_gap_per_version']:+.3f} / {p['reward_gap_last_quarter']:+.3f}"
                     for p in s["pairs"]))
    return "\n".join(lines)


def chaos(cluster: LocalCluster, *, duration_s: float, kill_every_s: float | None) -> dict:
    """Run a started cluster for `duration_s` from its first RL step, SIGKILLing one rollout server every
    `kill_every_s` (round robin; None: undisturbed) and restarting it on the same port; then preempt the trainer
    (SIGTERM: it checkpoints and exits). Returns the samples trained per second over the window and the kills."""
    while not read_metrics(cluster.out):
        if cluster.trainer.proc.poll() is not None:
            raise RuntimeError(f"the trainer exited before its first step; see {cluster.logs}")
        time.sleep(0.1)
    first = read_metrics(cluster.out)[0]
    start = time.monotonic()
    kills = 0
    while (now := time.monotonic() - start) < duration_s:
        if kill_every_s is not None and now >= (kills + 1) * kill_every_s:
            index = kills % len(cluster.servers)
            cluster.servers[index].stop(signal.SIGKILL)
            cluster.start_server(index)
            kills += 1
        if cluster.trainer.proc.poll() is not None:
            raise RuntimeError(f"the trainer exited during the run; see {cluster.logs}")
        time.sleep(0.1)
    cluster.trainer.stop(signal.SIGTERM, timeout=120)
    rows = [r for r in read_metrics(cluster.out) if r["step"] > first["step"]]
    window = rows[-1]["wall_seconds"] - first["wall_seconds"] if rows else float("nan")
    return {"kills": kills, "steps": len(rows), "samples_per_second": sum(r["samples"] for r in rows) / window}


def chaos_bench(base: dict, duration_s: float, kill_every_s: float, root: Path) -> str:
    results = {}
    for name, every in (("undisturbed", None), ("chaos", kill_every_s)):
        path = run_file(base, name, root, rollout={"min_servers": 4, "max_servers": 4},
                        training={"steps": 100_000, "checkpoint_every": 100_000})
        cluster = LocalCluster(str(path), load(str(path)))
        try:
            cluster.start()
            results[name] = chaos(cluster, duration_s=duration_s, kill_every_s=every)
        finally:
            cluster.stop()
    u, c = results["undisturbed"], results["chaos"]
    return (f"| run | rollout servers killed | steps | samples/s |\n|---|---|---|---|\n"
            f"| undisturbed | 0 | {u['steps']} | {u['samples_per_second']:.1f} |\n"
            f"| one SIGKILLed every {kill_every_s:g} s | {c['kills']} | {c['steps']} | {c['samples_per_second']:.1f} |\n"
            f"\nchaos / undisturbed throughput: {c['samples_per_second'] / u['samples_per_second']:.2f}")


def main(argv: list[str]) -> int:
    import argparse

    if "--gpu" in argv:  # the RL-system benchmark on one GPU: its own flags (tools/bench/rl_gpu.py)
        from .rl_gpu import main as gpu_main

        return gpu_main([a for a in argv if a != "--gpu"])

    parser = argparse.ArgumentParser(prog="moerl bench-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="configs/runs/local.yaml", help="the job to run both ways")
    parser.add_argument("--steps", type=int, default=400, help="RL steps of every synchronous run")
    parser.add_argument("--async-steps", type=int, default=None,
                        help="RL steps of every asynchronous run (default 1.5 x --steps): the goal is judged at 60%% "
                             "of the synchronous wall time, so an asynchronous run must last past it; 1.5 x the "
                             "steps does for any throughput ratio up to 2.5x")
    parser.add_argument("--async-staleness", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every this many versions")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rl.training.seed of each pair")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="split",
                        help="split: one rollout server and one trainer rank, each on its own core; shared: two of "
                             "each, placed by the OS")
    parser.add_argument("--chaos", action="store_true", help="measure rollout-server kills instead")
    parser.add_argument("--duration", type=float, default=90, help="--chaos: seconds of each run")
    parser.add_argument("--kill-every", type=float, default=20, help="--chaos: seconds between kills")
    parser.add_argument("--out", default="runs/bench-rl")
    parser.add_argument("--report", nargs="+", metavar="RESULTS_JSON",
                        help="print the table of recorded results (a run's results.json, or several pooled) instead "
                             "of running")
    args = parser.parse_args(argv)
    if args.report:
        print(table([r for path in args.report for r in json.loads(Path(path).read_text())]))
        return 0
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(Path(args.run).read_text())
    if args.chaos:
        text = chaos_bench(base, args.duration, args.kill_every, root)
        command = f"moerl bench-rl --chaos --run {args.run} --duration {args.duration:g} --kill-every {args.kill_every:g}"
        print(text)
        (root / "chaos.md").write_text(f"`{command}`\n\n{text}\n")
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench-rl pins a rollout server and a trainer to two different cores; this process "
                         f"may use {len(os.sched_getaffinity(0))}")
    async_steps = args.async_steps if args.async_steps is not None else round(1.5 * args.steps)
    command = (f"moerl bench-rl --run {args.run} --steps {args.steps} --async-steps {async_steps} "
               f"--async-staleness {args.async_staleness} "
               f"--eval-every {args.eval_every} --seeds {' '.join(map(str, args.seeds))} --layout {args.layout}")
    modes = (("sync", 0, args.steps), ("async", args.async_staleness, async_steps))
    results = []
    for i, seed in enumerate(args.seeds):
        for mode, staleness, steps in (modes if i % 2 == 0 else modes[::-1]):  # interleaved: load drift hits both
            results.append(bench_run(base, mode, staleness, steps, args.eval_every, root, seed=seed,
                                     layout=args.layout))
            r = results[-1]
            print(f"seed {seed} {mode}: {r['samples_per_second']:.1f} samples/s, final eval reward "
                  f"{r['final_reward']:.3f}, {r['wall_seconds']:.0f} s", flush=True)
            (root / "results.json").write_text(json.dumps(results, indent=1))  # a partial set survives a stop
    text = table(results)
    print(text)
    plot(results, root / "reward_vs_time.png")
    (root / "results.md").write_text(f"`{command}`\n\n{text}\n")
    return 0
