"""Chaos: four real rollout servers (the tiny model), one SIGKILLed every 10 s and restarted on its port, while
the orchestrator and an EP=2 trainer run; then the trainer is preempted (SIGTERM). Asserts the accounting, not the
timing: every completed sample is trained exactly once or dropped for a counted reason, none is lost, none trained
twice or past its staleness bound, no request failed for good; and what follows the preemption: the trainer
checkpoints the step it stopped at on both ranks (every trained step is in the checkpoint), and the checkpoint holds
the orchestrator's state with every batch not yet committed. The throughput against an undisturbed run is measured
by `moerl bench-rl --chaos` (workloads/BENCHMARKS-rl.md), one kill every 20 s. Kills 10 s apart still leave a
restarted server time to come back (about 7 s here) before the next kill takes another one. About 50 s on the
2-core machine."""
import json

import pytest
from rl_helpers import call, sample_accounting, trained_steps, write_run

from moe_rl_eks.core.run import load_run
from moe_rl_eks.tools.bench.rl import chaos
from moe_rl_eks.tools.local_run import LocalCluster
from moe_rl_eks.workloads.rl.checkpoint_dirs import latest as latest_checkpoint

# the real RL loop's processes on a 2-core machine: never beside another such run (make test's workers)
pytestmark = pytest.mark.xdist_group("rl_loop")


def test_rollout_servers_killed_every_10_s_lose_and_duplicate_no_sample(tmp_path):
    path = write_run(tmp_path, rollout={"min_servers": 4, "max_servers": 4},
                     orchestrator={"max_staleness": 1, "request_timeout_s": 10, "straggler_after_s": 3},
                     training={"steps": 10_000, "prompts_per_step": 4, "warmup_sft_steps": 1, "checkpoint_every": 10_000})
    cluster = LocalCluster(str(path), load_run(path))
    try:
        cluster.start()
        result = chaos(cluster, duration_s=25, kill_every_s=10)
        state = call("GET", f"{cluster.orchestrator.url}/v1/state")[1]
    finally:
        cluster.stop()
    assert result["kills"] == 2 and result["steps"] > 0
    acc = sample_accounting(cluster.out, state, max_staleness=1)
    steps = trained_steps(cluster.out)
    assert sorted(steps) == list(range(len(steps)))  # every step trained, once
    # after the preemption: both ranks checkpoint the last trained step, not an earlier one, and it is committed
    # (torchrun's agent itself exits 1 on the signal, SignalException, whatever its workers do: not asserted)
    checkpoint = latest_checkpoint(cluster.out / "checkpoints")
    assert checkpoint.name == f"step-{len(steps):08d}"
    log = (cluster.logs / "trainer.log").read_text()
    assert log.count(f"SIGTERM: checkpointing at step {len(steps)} and exiting") == 2
    assert f"checkpoint {checkpoint}" in log
    kept = json.loads((checkpoint / "orchestrator.json").read_text())
    # no checkpoint was committed before (checkpoint_every 10,000): every batch trained is kept, and no other
    assert kept["consumed"] == len(steps) * 4 and {int(s) for s in kept["batches"]} == set(steps)
    assert state["counts"]["failed_requests"] == 0, state["counts"]
    assert len(acc["trained_ids"]) == len(steps) * 4 * 8
