"""`moerl bench-routing`: routing replay's transport at RL scale, on this machine's CPU and disk.

One step of the flagship run's shape by default: 1,024 samples (64 groups of 16) of 8,192 fed positions each (a
512-token prompt, 7,681 completion tokens), 48 layers, top-8 of 128 experts: 3 MiB of uint8 ids a sample, 3.2 GB a
step. Three figures per compression:
- write: the rollout server's `RoutingStore.write` of each sample's ids (random uniform ids: the worst case for
  compression; real routing is skewed, so zlib's ratio here is its floor);
- orchestrator: a separate process running the orchestrator's code path on the servers' answers (the JSON of
  `/v1/completions` with `routing_ref`, read by `read_completion`, buffered, batched, the `/v1/batch` and
  `/v1/state` bodies encoded, then the batch's routing deleted once a checkpoint past its step is committed), its
  peak RSS and CPU seconds; the same with routing replay off, so the difference is what routing costs it;
- read: the trainer's `RoutingStore.read` of every sample (all ranks' shares together: the file, its size and XXH3
  checks, zlib's inflate), then apart the conversion to the int64 ids the model takes (the trainer's cost whatever
  the transport).
The page cache is warm (the objects were just written): the disk's own speed is bench-load's subject, not this
one's. Only the machine's own temporary directory and no network are used.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEED = 0


def orchestrate(responses: Path, routing_dir: str, groups: int, prompt_tokens: int) -> dict:
    """The child process: the orchestrator's code path over the answers in `responses` (JSON lines)."""

    from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer
    from moe_rl_eks.workloads.orchestrator.driver import sample_of
    from moe_rl_eks.workloads.rl.openai_api import read_completion
    from moe_rl_eks.workloads.rl.protocol import Group, PromptRecord, VersionRef
    from moe_rl_eks.workloads.rl.routing_store import RoutingStore

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu0, wall0 = time.process_time(), time.perf_counter()
    buf = GroupBuffer(prompts_per_step=groups, max_staleness=0, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 0))
    prompt_ids = [1] * prompt_tokens
    with open(responses) as f:
        for i, line in enumerate(f):
            completion = read_completion(json.loads(line))
            buf.issue(PromptRecord(i, prompt_ids, "", None))
            samples = [sample_of(c, float(c.index % 2)) for c in completion.choices]
            buf.complete(Group(f"p{i}", i, prompt_ids, completion.version, samples), rewards_failed=0,
                         dynamic_sampling=False)
    batch = buf.batch(0, 0, 0, lambda rewards: [r - sum(rewards) / len(rewards) for r in rewards])
    batch_body = len(json.dumps(batch.to_json()))  # GET /v1/batch
    state_body = len(json.dumps(buf.snapshot().to_json()))  # GET /v1/state (a checkpoint's copy)
    buf.set_trainer(VersionRef(0, 1))
    buf.batch(1, 0, 1, lambda rewards: rewards)  # the checkpoint of step 1 is committed: batch 0's routing goes
    deleted = RoutingStore(routing_dir).delete(buf.take_released()) if routing_dir else 0
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "baseline_rss_bytes": baseline, "cpu_s": time.process_time() - cpu0,
            "wall_s": time.perf_counter() - wall0, "batch_body_bytes": batch_body, "state_body_bytes": state_body,
            "samples": len(batch.samples), "deleted_bytes": deleted}


def answers(path: Path, refs: list | None, groups: int, group_size: int, completion: int) -> None:
    """The servers' `/v1/completions` answers, one JSON line a group, with `routing_ref`s (or none)."""
    tokens, logprobs = [7] * completion, [-0.5] * completion
    with open(path, "w") as f:
        for g in range(groups):
            choices = [{"index": j, "text": "", "finish_reason": "length", "token_ids": tokens,
                        "logprobs": {"tokens": [], "token_logprobs": logprobs, "top_logprobs": None,
                                     "text_offset": []},
                        "routing_ref": refs[g * group_size + j].to_json() if refs else None,
                        "weight_versions": [{"version": 0, "lineage": 0, "tokens": completion}]}
                       for j in range(group_size)]
            f.write(json.dumps({"id": f"cmpl-{g}", "object": "text_completion", "created": 0, "model": "bench",
                                "weight_version": 0, "weight_lineage": 0, "choices": choices}) + "\n")


def child(responses: Path, routing_dir: str, args) -> dict:
    """The orchestrator's code path in a fresh process (its RSS is the orchestrator's alone)."""
    code = ("import json; from pathlib import Path; from moe_rl_eks.tools.bench.routing import orchestrate; "
            f"print(json.dumps(orchestrate(Path({str(responses)!r}), {routing_dir!r}, {args.groups}, "
            f"{args.prompt_tokens})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"the orchestrator process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_one(root: Path, compression: str, args) -> dict:
    import numpy as np

    from moe_rl_eks.workloads.rl.routing_store import RoutingStore

    store = RoutingStore(root / f"routing-{compression}", compression)
    rng = np.random.default_rng(SEED)
    positions = args.prompt_tokens + args.completion_tokens - 1
    distinct = [rng.integers(0, args.experts, size=(positions, args.layers, args.k), dtype=np.uint8)
                for _ in range(8)]  # made before the clock starts; 8 kept so no write sees the same array twice in a row
    samples = args.groups * args.group_size
    start = time.perf_counter()
    refs = [store.write(f"cmpl-{i // args.group_size}-{i % args.group_size}", distinct[i % 8], args.experts)
            for i in range(samples)]
    write_s = time.perf_counter() - start
    stored = sum(r.bytes for r in refs)
    array_bytes = sum(r.array_bytes for r in refs)
    read_s = convert_s = 0.0
    for r in refs:
        start = time.perf_counter()
        ids = store.read(r)
        read_s += (middle := time.perf_counter()) - start
        ids.astype(np.int64)
        convert_s += time.perf_counter() - middle
    responses = root / "answers.jsonl"
    answers(responses, refs, args.groups, args.group_size, args.completion_tokens)
    with_routing = child(responses, str(store.root), args)
    left = sum(1 for _ in store.root.iterdir())
    return {"compression": compression, "samples": samples, "array_bytes": array_bytes, "stored_bytes": stored,
            "write_s": write_s, "read_s": read_s, "write_bytes_per_s": array_bytes / write_s,
            "read_bytes_per_s": array_bytes / read_s, "int64_bytes_per_s": array_bytes / convert_s, "orchestrator": with_routing, "objects_left": left}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-routing", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=7681, help="positions = prompt + completion - 1")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--compression", nargs="+", default=["none", "zlib"], choices=["none", "zlib"])
    parser.add_argument("--dir", type=Path, help="where the store goes (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each orchestrator process may take")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-routing-", dir=args.dir))
    try:
        results = [run_one(root, c, args) for c in args.compression]
        answers(root / "answers.jsonl", None, args.groups, args.group_size, args.completion_tokens)
        without = child(root / "answers.jsonl", "", args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    positions = args.prompt_tokens + args.completion_tokens - 1
    print(f"{args.groups * args.group_size} samples x {positions} positions x {args.layers} layers x top-{args.k} "
          f"of {args.experts} experts")
    print("| compression | stored GB (of array GB) | write GB/s | read GB/s (then to int64) | orchestrator peak RSS "
          "MiB (over start) | orchestrator CPU s | /v1/batch MB | /v1/state MB | objects left after the checkpoint |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        o = r["orchestrator"]
        print(f"| {r['compression']} | {r['stored_bytes'] / 1e9:.2f} ({r['array_bytes'] / 1e9:.2f}) | "
              f"{r['write_bytes_per_s'] / 1e9:.2f} | {r['read_bytes_per_s'] / 1e9:.2f} "
              f"({r['int64_bytes_per_s'] / 1e9:.2f}) | "
              f"{o['peak_rss_bytes'] / 2**20:.0f} (+{(o['peak_rss_bytes'] - o['baseline_rss_bytes']) / 2**20:.0f}) | "
              f"{o['cpu_s']:.1f} | {o['batch_body_bytes'] / 1e6:.1f} | {o['state_body_bytes'] / 1e6:.1f} | "
              f"{r['objects_left']} |")
    print(f"| routing replay off | - | - | - | {without['peak_rss_bytes'] / 2**20:.0f} "
          f"(+{(without['peak_rss_bytes'] - without['baseline_rss_bytes']) / 2**20:.0f}) | {without['cpu_s']:.1f} | "
          f"{without['batch_body_bytes'] / 1e6:.1f} | {without['state_body_bytes'] / 1e6:.1f} | - |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "routing_off": without}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
