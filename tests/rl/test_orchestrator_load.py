"""Load: the orchestrator against 128 lightweight HTTP endpoints on 127.0.0.1 that answer like rollout servers
(in another process), 16 requests in flight each.

- 2,048 concurrent requests, sustained over several waves: the endpoints hold every completion until all 2,048
  of a wave are in flight (so the count does not depend on how fast this machine sends them).
- None hedged merely because it waited to be sent: endpoints answer 0.5 s after a request arrives, the straggler
  clock is 1.5 s, each server has room for 4 more requests, and sending a wave of 2,048 takes the event loop longer
  than 1.5 s, so a clock started when the request is issued rather than sent would hedge (checked: 2,293 hedges).

Prints the orchestrator's CPU time per request (a figure, not an assertion)."""
import asyncio
import multiprocessing
import time

import fake_rollout
from rl_helpers import tiny_run

from moe_rl_eks.workloads.orchestrator.app import build
from moe_rl_eks.workloads.rl.protocol import VersionRef

SERVERS, PER_SERVER, ROOM, WAVES = 128, 16, 4, 3
CONCURRENT = SERVERS * PER_SERVER


def drive(tmp_path, waves: int, straggler_after_s: float, **endpoint_options) -> tuple[dict, int, list, float, float]:
    """`waves` synchronous steps of CONCURRENT prompts against the endpoints -> (counts, peak concurrent
    completions, per-endpoint stats, orchestrator CPU seconds, wall seconds)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=fake_rollout.serve, args=(SERVERS, child), kwargs=endpoint_options, daemon=True)
    proc.start()
    try:
        urls = parent.recv()
        # A deadline far past any wave's sending (core/deadlines.py: 1.5 s + max_tokens / the floor rate, 4.5 s at
        # local.yaml's floor of 1 token/s): on a loaded machine the event loop took longer than 4.5 s to send a
        # wave, and the requests still waiting timed out and were retried (counted as retries, not hedges)
        run = tiny_run(tmp_path, training={"prompts_per_step": CONCURRENT}, algorithm={"group_size": 2},
                       rollout={"min_row_tokens_per_s": 0.05},
                       orchestrator={"max_staleness": 0, "max_inflight_requests": PER_SERVER + ROOM,
                                     "straggler_after_s": straggler_after_s, "request_timeout_s": 120})

        async def scenario():
            orch = build(run, urls, token=None)
            await orch.start()
            cpu, wall = time.process_time(), time.monotonic()
            for step in range(waves):
                await orch.publish(VersionRef(0, step))
                assert await orch.batch(step, 0, timeout_s=120) is not None, f"no batch for step {step}"
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            counts = dict(orch.buffer.counts)
            await orch.stop()
            return counts, cpu, wall

        counts, cpu, wall = asyncio.run(scenario())
        parent.send("stats")
        peak, stats = parent.recv()
    finally:
        parent.send("stop")
        proc.join(timeout=30)
    return counts, peak, stats, cpu, wall


def test_2048_concurrent_requests_over_128_servers_sustained(tmp_path, capsys):
    counts, peak, stats, cpu, wall = drive(tmp_path, WAVES, straggler_after_s=600, wave=CONCURRENT, delay_s=60)
    requests = WAVES * CONCURRENT
    assert peak == CONCURRENT  # each wave was released only once all of it was in flight
    assert counts["completed"] == requests and counts["failed_requests"] == 0
    assert max(p for _, p, _ in stats) <= PER_SERVER + ROOM and sum(c for c, _, _ in stats) == requests
    with capsys.disabled():
        print(f"\nload: {SERVERS} servers x {PER_SERVER} in flight, {peak} concurrent, {requests} requests in "
              f"{wall:.1f} s; orchestrator CPU {1e3 * cpu / requests:.2f} ms per request (incl. scoring 2 "
              f"completions each), this machine's CPU")


def test_no_request_is_hedged_merely_because_it_waited_to_be_sent(tmp_path):
    counts, _, stats, _, _ = drive(tmp_path, WAVES, straggler_after_s=1.5, delay_s=0.5)
    assert counts["completed"] == WAVES * CONCURRENT and counts["failed_requests"] == 0
    assert counts["hedges"] == 0 and counts["retries"] == 0
    assert sum(cancelled for _, _, cancelled in stats) == 0
