"""`moerl bench-rl`: the same local job synchronous (max_staleness 0) and asynchronous, side by side, with one
rollout server and one trainer rank each pinned to its own core, so the figure measures overlap, not contention.
Prints a table (samples/s, trainer idle, rollout idle, final evaluation reward) and writes it with the command
under the output directory."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import yaml

from .local_run import LocalCluster, evaluate, final_weights, read_metrics
from .runtime import http_json, load

ROLLOUT_CPU, TRAINER_CPU = 0, 1


def bench_run(base: dict, mode: str, max_staleness: int, steps: int, root: Path) -> dict:
    data = json.loads(json.dumps(base))
    data["name"] = f"bench-{mode}"
    data["parallelism"] = {"ep_backend": "local", "ranks_per_node": 1}
    data["rollout"].update(min_servers=1, max_servers=1)
    data["rl"]["orchestrator"]["max_staleness"] = max_staleness
    data["rl"]["training"].update(steps=steps, output_dir=str(root / mode), checkpoint_every=steps)
    shutil.rmtree(root / mode, ignore_errors=True)  # a fresh run, not a resume of the last benchmark
    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
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
        busy0, t0 = http_json("GET", f"{server.url}/health", timeout=10)["busy_seconds"], time.monotonic()
        cluster.trainer.proc.wait(timeout=1800)
        busy1, t1 = http_json("GET", f"{server.url}/health", timeout=10)["busy_seconds"], time.monotonic()
    finally:
        cluster.stop()
    rows = read_metrics(cluster.out)
    last = rows[-1]
    wall = last["wall_seconds"] - first["wall_seconds"]
    waited = (last["trainer_idle_fraction"] * last["wall_seconds"] - first["trainer_idle_fraction"] * first["wall_seconds"])
    final = evaluate(run, final_weights(run, cluster.out))
    return {"mode": mode, "max_staleness": max_staleness, "steps": len(rows),
            "samples_per_second": sum(r["samples"] for r in rows[1:]) / wall,
            "trainer_idle_fraction": waited / wall, "rollout_idle_fraction": 1 - (busy1 - busy0) / (t1 - t0),
            "mean_staleness": sum(r["staleness_mean"] for r in rows) / len(rows),
            "final_reward": final["reward_mean"]}


def table(results: list[dict]) -> str:
    lines = ["| mode | max_staleness | samples/s | trainer idle | rollout idle | mean staleness | final reward |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['max_staleness']} | {r['samples_per_second']:.1f} | "
                     f"{r['trainer_idle_fraction']:.2f} | {r['rollout_idle_fraction']:.2f} | "
                     f"{r['mean_staleness']:.2f} | {r['final_reward']:.3f} |")
    speedup = results[1]["samples_per_second"] / results[0]["samples_per_second"]
    lines.append(f"\nasync / sync throughput: {speedup:.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="moerl bench-rl", description=__doc__)
    parser.add_argument("--run", default="configs/runs/local.yaml", help="the job to run both ways")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-rl")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench-rl pins a rollout server and a trainer to two different cores; this process "
                         f"may use {len(os.sched_getaffinity(0))}")
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(Path(args.run).read_text())
    results = [bench_run(base, "sync", 0, args.steps, root),
               bench_run(base, "async", args.async_staleness, args.steps, root)]
    text = table(results)
    print(text)
    command = f"moerl bench-rl --run {args.run} --steps {args.steps} --async-staleness {args.async_staleness}"
    (root / "results.md").write_text(f"`{command}`\n\n{text}\n")
    (root / "results.json").write_text(json.dumps(results, indent=1))
    return 0
