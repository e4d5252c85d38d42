"""Faults, on the real multi-process loop (rollout servers, orchestrator, torchrun trainer with EP=2 over gloo):
a rollout server killed and another straggling, a trainer killed and resumed (bitwise in synchronous mode, no
sample lost or used twice in asynchronous mode)."""
import signal

import torch
from rl_helpers import call, sample_accounting, trained_steps, wait_until, write_run
from safetensors.torch import load_file

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.rl import checkpoint as ckpt
from moe_rl_eks.workloads.rl.local_run import LocalCluster, read_metrics
from moe_rl_eks.workloads.rl.weights import version_name

SHORT = {"prompts_per_step": 4, "warmup_sft_steps": 2}


def start(path, **env):
    cluster = LocalCluster(str(path), load_run(path), env)
    cluster.start()
    return cluster


def finish(cluster, timeout=180):
    """Wait for the trainer to exit 0; return the orchestrator's final state."""
    wait_until(lambda: cluster.trainer.proc.poll() is not None, timeout, "the trainer to finish")
    assert cluster.trainer.proc.returncode == 0, (cluster.logs / "trainer.log").read_text()[-3000:]
    return call("GET", f"{cluster.orchestrator.url}/v1/state")[1]


def stop_while_it_holds_a_request(cluster, server, attempts=20):
    """SIGSTOP `server` at a moment the orchestrator has a request on it, until that request gets hedged."""
    orch = cluster.orchestrator.url
    for _ in range(attempts):
        before = call("GET", f"{orch}/v1/state")[1]["counts"]["retries"]
        wait_until(lambda: call("GET", f"{orch}/health")[1]["servers"][server.url]["in_flight"] > 0, 60,
                   "a request on the server", interval=0.002)
        server.send(signal.SIGSTOP)  # alive, holding the connection, never answering
        try:
            return wait_until(lambda: call("GET", f"{orch}/v1/state")[1]["counts"]["retries"] > before, 5,
                              "the straggling request to be re-sent")
        except AssertionError:  # it had answered just before the signal: try again
            server.send(signal.SIGCONT)
    raise AssertionError("never caught the server holding a request")


def test_killed_and_straggling_rollout_servers_lose_or_duplicate_no_sample(tmp_path):
    steps = 24
    path = write_run(tmp_path, rollout={"min_servers": 3, "max_servers": 3},
                     orchestrator={"max_staleness": 1, "request_timeout_s": 8, "straggler_after_s": 1.0},
                     training={**SHORT, "steps": steps, "checkpoint_every": 12})
    cluster = start(path)
    out = cluster.out
    straggler, victim = cluster.servers[0], cluster.servers[1]
    try:
        wait_until(lambda: len(read_metrics(out)) >= 2, 180, "two steps")
        stop_while_it_holds_a_request(cluster, straggler)
        stopped_at = len(read_metrics(out))
        wait_until(lambda: len(read_metrics(out)) >= stopped_at + 3, 60, "progress while a server straggles")
        victim.stop(signal.SIGKILL)
        state = finish(cluster)
    finally:
        straggler.send(signal.SIGCONT)
        cluster.stop()
    acc = sample_accounting(out, state)
    n = 8 * SHORT["prompts_per_step"]
    assert sorted(trained_steps(out)) == list(range(steps)) and len(acc["trained_ids"]) == steps * n
    assert state["counts"]["failed_requests"] == 0


def final_weights(out, version):
    return load_file(str(out / "weights" / version_name(version) / "model.safetensors"))


def kill_trainer_after_first_checkpoint(cluster, steps):
    """SIGKILL the trainer as soon as it has a checkpoint, restart it, and check it resumed mid-run."""
    root = cluster.out / "checkpoints"
    wait_until(lambda: ckpt.latest(root), 180, "the first checkpoint", interval=0.05)
    cluster.trainer.stop(signal.SIGKILL)
    at = int(ckpt.latest(root).name.split("-")[1])
    assert at < steps, "the trainer finished before it could be killed; the test proves nothing"
    cluster.start_trainer()
    return at


def test_trainer_killed_and_resumed_reaches_bitwise_the_same_parameters_when_synchronous(tmp_path):
    steps = 10
    sections = dict(rollout={"min_servers": 1, "max_servers": 1, "max_batch_size": 8},
                    orchestrator={"max_staleness": 0}, training={**SHORT, "steps": steps, "checkpoint_every": 2})
    (tmp_path / "a").mkdir()
    straight = start(write_run(tmp_path / "a", **sections))
    try:
        finish(straight)
    finally:
        straight.stop()
    (tmp_path / "b").mkdir()
    resumed = start(write_run(tmp_path / "b", **sections))
    try:
        at = kill_trainer_after_first_checkpoint(resumed, steps)
        finish(resumed)
    finally:
        resumed.stop()
    assert f"at step {at}" in (resumed.logs / "trainer.log").read_text()
    a, b = final_weights(straight.out, steps), final_weights(resumed.out, steps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], final_weights(straight.out, steps - 2)["lm_head.weight"])


def test_trainer_preempted_by_sigterm_checkpoints_exits_and_resumes_asynchronously_with_no_sample_lost(tmp_path):
    steps = 12
    path = write_run(tmp_path, rollout={"min_servers": 1, "max_servers": 1},
                     orchestrator={"max_staleness": 2}, training={**SHORT, "steps": steps, "checkpoint_every": 100})
    cluster = start(path)
    try:
        wait_until(lambda: len(read_metrics(cluster.out)) >= 3, 180, "three steps", interval=0.05)
        cluster.trainer.send(signal.SIGTERM)
        wait_until(lambda: cluster.trainer.proc.poll() is not None, 60, "the preempted trainer to exit")
        log = (cluster.logs / "trainer.log").read_text()
        assert "SIGTERM: checkpointing at step" in log and "Traceback" not in log.split("SIGTERM")[0]
        at = int(ckpt.latest(cluster.out / "checkpoints").name.split("-")[1])
        assert 3 <= at < steps  # not a multiple of checkpoint_every: written because of the signal
        cluster.start_trainer()
        state = finish(cluster)
    finally:
        cluster.stop()
    assert f"at step {at}" in (cluster.logs / "trainer.log").read_text()
    acc = sample_accounting(cluster.out, state)
    assert sorted(trained_steps(cluster.out)) == list(range(steps))
    assert len(acc["trained_ids"]) == steps * 8 * SHORT["prompts_per_step"]
