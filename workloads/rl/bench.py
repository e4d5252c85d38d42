"""`moerl bench-rl`: the same local job synchronous (max_staleness 0) and asynchronous, one after the other, with
one rollout server and one trainer rank each pinned to its own core, so the figure measures overlap, not
contention. Prints a table (samples/s, trainer idle, rollout idle, evaluation reward at the end) and the wall
time the asynchronous run took to reach the synchronous run's final evaluation reward; plots evaluation reward
against wall-clock time for both. Every `--eval-every`-th published version is evaluated after the run (so the
evaluation does not take time from it), placed at the wall time its step finished.

`--chaos`: four rollout servers, undisturbed and then with one SIGKILLed every `--kill-every` seconds and
restarted: samples/s of both and their ratio.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import yaml

from .local_run import LocalCluster, read_metrics
from .runtime import load

ROLLOUT_CPU, TRAINER_CPU = 0, 1


def busy_seconds(url: str) -> float:
    """The rollout server's generating time so far (its moerl_rollout_busy_seconds_total counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    from moe_rl_eks.core import metrics as M

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == M.ROLLOUT_BUSY_SECONDS.name:
                return sample.value
    raise RuntimeError(f"{url}/metrics has no {M.ROLLOUT_BUSY_SECONDS.name}")


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


def bench_run(base: dict, mode: str, max_staleness: int, steps: int, eval_every: int, root: Path) -> dict:
    path = run_file(base, mode, root, parallelism={"ep_backend": "local", "ranks_per_node": 1},
                    rollout={"min_servers": 1, "max_servers": 1}, orchestrator={"max_staleness": max_staleness},
                    training={"steps": steps, "checkpoint_every": steps},
                    weights={"keep_versions": steps + 1})  # every version stays, for the evaluation afterwards
    run = load(str(path))
    cluster = LocalCluster(str(path), run)
    try:
        server = cluster.start_server(0, cpus={ROLLOUT_CPU})
        cluster.start_orchestrator(cpus={ROLLOUT_CPU})
        cluster.start_trainer(cpus={TRAINER_CPU})
        # Measure from the first RL step (after start-up and warm-up) to the last.
        while not read_metrics(cluster.out):
            if cluster.trainer.proc.poll() is not None:
                raise RuntimeError(f"{mode}: trainer exited early; see {cluster.logs}")
            time.sleep(0.05)
        first = read_metrics(cluster.out)[0]
        busy0, t0 = busy_seconds(server.url), time.monotonic()
        cluster.trainer.proc.wait(timeout=3600)
        busy1, t1 = busy_seconds(server.url), time.monotonic()
    finally:
        cluster.stop()
    rows = read_metrics(cluster.out)
    last = rows[-1]
    wall = last["wall_seconds"] - first["wall_seconds"]
    waited = (last["trainer_idle_fraction"] * last["wall_seconds"] - first["trainer_idle_fraction"] * first["wall_seconds"])
    curve = evaluation_curve(run, cluster.out, rows, first["wall_seconds"] - first["step_seconds"], eval_every)
    return {"mode": mode, "max_staleness": max_staleness, "steps": len(rows),
            "samples_per_second": sum(r["samples"] for r in rows[1:]) / wall,
            "trainer_idle_fraction": waited / wall, "rollout_idle_fraction": 1 - (busy1 - busy0) / (t1 - t0),
            "mean_staleness": sum(r["staleness_mean"] for r in rows) / len(rows),
            "final_reward": curve[-1]["reward"], "wall_seconds": curve[-1]["seconds"], "curve": curve}


def evaluation_curve(run, out: Path, rows: list[dict], origin: float, every: int) -> list[dict]:
    """Evaluation reward of versions 0, every, 2 x every, ..., and the last, each at the wall time (seconds
    from the start of the first RL step) its step finished."""
    from .evaluation import evaluate_checkpoint
    from .weights import IncompleteVersion, open_store

    store = open_store(run.rl.weights, out / "weights")
    latest = store.latest()
    finished = {r["step"]: r["wall_seconds"] - origin for r in rows}
    finished[0] = 0.0
    curve = []
    for target in sorted({*range(0, latest.version + 1, every), latest.version}):
        # The background publisher may skip a version a newer one superseded: take the next one published.
        for v in range(target, latest.version + 1):
            try:
                directory = store.fetch(v, out / "weights-cache")
            except (FileNotFoundError, IncompleteVersion):
                continue
            if not curve or curve[-1]["version"] != v:
                reward = evaluate_checkpoint(run, directory)["eval/reward_mean"]
                curve.append({"version": v, "seconds": finished[v], "reward": reward})
            break
    return curve


def time_to_reach(curve: list[dict], reward: float) -> float | None:
    """Wall seconds until a curve first reaches `reward`; None if it never does."""
    return next((p["seconds"] for p in curve if p["reward"] >= reward), None)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([p["seconds"] for p in r["curve"]], [p["reward"] for p in r["curve"]], marker="o",
                label=f"{r['mode']} (max_staleness {r['max_staleness']})")
    ax.set_xlabel("wall-clock seconds from the first RL step (CPU, this machine)")
    ax.set_ylabel("evaluation mean reward")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: list[dict]) -> str:
    lines = ["| mode | max_staleness | samples/s | trainer idle | rollout idle | mean staleness | final eval reward | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['max_staleness']} | {r['samples_per_second']:.1f} | "
                     f"{r['trainer_idle_fraction']:.2f} | {r['rollout_idle_fraction']:.2f} | "
                     f"{r['mean_staleness']:.2f} | {r['final_reward']:.3f} | {r['wall_seconds']:.0f} |")
    sync, async_ = results
    reached = time_to_reach(async_["curve"], sync["final_reward"])
    lines.append(f"\nasync / sync throughput: {async_['samples_per_second'] / sync['samples_per_second']:.2f}x")
    lines.append("async reached sync's final evaluation reward " + (
        f"{sync['final_reward']:.3f} after {reached:.0f} s = {reached / sync['wall_seconds']:.0%} of sync's "
        f"{sync['wall_seconds']:.0f} s" if reached is not None else
        f"{sync['final_reward']:.3f}: never within its {async_['wall_seconds']:.0f} s"))
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

    parser = argparse.ArgumentParser(prog="moerl bench-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="configs/runs/local.yaml", help="the job to run both ways")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every this many versions")
    parser.add_argument("--chaos", action="store_true", help="measure rollout-server kills instead")
    parser.add_argument("--duration", type=float, default=90, help="--chaos: seconds of each run")
    parser.add_argument("--kill-every", type=float, default=20, help="--chaos: seconds between kills")
    parser.add_argument("--out", default="runs/bench-rl")
    args = parser.parse_args(argv)
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
    results = [bench_run(base, "sync", 0, args.steps, args.eval_every, root),
               bench_run(base, "async", args.async_staleness, args.steps, args.eval_every, root)]
    text = table(results)
    print(text)
    plot(results, root / "reward_vs_time.png")
    command = (f"moerl bench-rl --run {args.run} --steps {args.steps} --async-staleness {args.async_staleness} "
               f"--eval-every {args.eval_every}")
    (root / "results.md").write_text(f"`{command}`\n\n{text}\n")
    (root / "results.json").write_text(json.dumps(results, indent=1))
    return 0
