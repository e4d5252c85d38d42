"""Load: the orchestrator against 128 lightweight HTTP endpoints on 127.0.0.1 that answer like rollout servers
(in another process), 16 requests in flight each: 2,048 concurrent requests, several rounds, none hedged merely
because it waited to be sent (sending a wave of 2,048 takes the event loop longer than the straggler clock, and
each server has room for 4 more, so a clock started at issue would hedge). Prints the orchestrator's CPU time per
request (a figure, not an assertion)."""
import asyncio
import multiprocessing
import time

import fake_rollout
from rl_helpers import tiny_run

from moe_rl_eks.workloads.rl.orchestrator.app import build
from moe_rl_eks.workloads.rl.protocol import VersionRef

SERVERS, PER_SERVER, ROUNDS = 128, 16, 3
ROOM = 4  # in-flight slots per server beyond the wave: where a hedge could go


def test_2048_concurrent_requests_over_128_servers_without_a_spurious_hedge(tmp_path, capsys):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=fake_rollout.serve, args=(SERVERS, child), kwargs={"delay_s": 0.5}, daemon=True)
    proc.start()
    try:
        urls = parent.recv()
        concurrent = SERVERS * PER_SERVER
        # one step = 2,048 prompts; synchronous, so each round is exactly one full wave of requests
        run = tiny_run(tmp_path, training={"prompts_per_step": concurrent}, algorithm={"group_size": 2},
                       orchestrator={"max_staleness": 0, "max_inflight_requests": PER_SERVER + ROOM,
                                     "straggler_after_s": 1.5, "request_timeout_s": 60})

        async def scenario():
            orch = build(run, urls, token=None)
            await orch.start()
            peak, started_cpu, started = 0, time.process_time(), time.monotonic()
            for step in range(ROUNDS):
                await orch.publish(VersionRef(0, step))
                waiter = asyncio.ensure_future(orch.batch(step, 0, timeout_s=120))
                while not waiter.done():
                    await asyncio.sleep(0.25)
                    parent.send("in_flight")
                    peak = max(peak, await asyncio.to_thread(parent.recv))
                assert waiter.result() is not None, f"no batch for step {step}"
            cpu, wall = time.process_time() - started_cpu, time.monotonic() - started
            counts = dict(orch.buffer.counts)
            await orch.stop()
            return peak, cpu, wall, counts

        peak, cpu, wall, counts = asyncio.run(scenario())
        parent.send("stats")
        stats = parent.recv()
    finally:
        parent.send("stop")
        proc.join(timeout=30)
    requests = ROUNDS * concurrent
    assert counts["completed"] == requests and counts["failed_requests"] == 0
    assert counts["hedges"] == 0 and counts["retries"] == 0  # answers take 0.5 s, the straggler clock 1.5 s
    assert max(p for _, p, _ in stats) <= PER_SERVER + ROOM and sum(c for c, _, _ in stats) == requests
    assert peak >= 0.95 * concurrent, peak  # the whole wave was in flight at once (sampled every 0.25 s)
    with capsys.disabled():
        print(f"\nload: {SERVERS} servers x {PER_SERVER} in flight, peak {peak} concurrent, {requests} requests in "
              f"{wall:.1f} s; orchestrator CPU {1e3 * cpu / requests:.2f} ms per request (incl. scoring {2} "
              f"completions each), this machine's CPU")
