"""Orchestrator rules without servers: staleness bound on issuing, stale groups dropped and counted, dynamic
sampling, batches idempotent by step and in prompt order."""
from types import SimpleNamespace

import pytest
from rl_helpers import tiny_run

from moe_rl_eks.workloads.rl.orchestrator import Attempt, Group, Orchestrator, Server, expand_endpoint, resume_state


def orchestrator(tmp_path, **sections):
    run = tiny_run(tmp_path, training={"prompts_per_step": 2}, **sections)
    return Orchestrator(run, ["http://127.0.0.1:9"], None, tmp_path / "events.jsonl")


def complete(orch, index, version, rewards=(1.0, 0.0)):
    orch.in_flight[f"p{index}"] = Attempt(index, 0.0)
    samples = [{"completion_ids": [5, 2], "logprobs": [-1.0, -0.5], "reward": r, "finished": True} for r in rewards]
    orch._completed(Group(f"p{index}", index, [1, 4], version, samples))


def test_groups_too_stale_for_the_step_are_dropped_and_counted(tmp_path):
    orch = orchestrator(tmp_path, orchestrator={"max_staleness": 1})
    for index, version in [(3, 2), (0, 0), (1, 1), (2, 2)]:
        complete(orch, index, version)
    batch = orch.batch(step=2, committed=0, timeout=0.1)
    # version 0 lags step 2 by 2 > max_staleness 1: dropped; the next two in arrival order, sorted by prompt
    assert [s["id"] for s in batch["samples"]] == ["p1/0", "p1/1", "p3/0", "p3/1"]
    assert orch.counts["dropped_stale_groups"] == 1
    assert b"moerl_samples_dropped_stale_total 2.0" in orch.metrics.exposition()
    assert batch["stats"]["staleness_mean"] == 0.5 and batch["stats"]["reward_mean"] == 0.5
    # GRPO: (1 - 0.5) / unbiased std 0.7071
    assert [s["advantage"] for s in batch["samples"][:2]] == pytest.approx([0.70711, -0.70711], abs=1e-5)
    assert orch.batch(step=2, committed=0, timeout=0.1) is batch  # a restarted trainer gets the same batch
    assert orch.batch(step=3, committed=0, timeout=0.1) is None  # one group left, two needed


def test_no_new_request_beyond_the_staleness_budget(tmp_path):
    orch = orchestrator(tmp_path, orchestrator={"max_staleness": 0})
    # synchronous: while the trainer is at version 0, only step 0's two groups may be outstanding
    complete(orch, 0, 0)
    orch.in_flight["p1"] = Attempt(1, 0.0)
    assert orch._issuable() == 0
    orch.trainer_version = 1
    assert orch._issuable() == 2  # step 1's two groups
    orch.retry.append("p1")  # a request no server is working on goes out again, budget or not
    assert orch._issuable() == 3
    async_orch = orchestrator(tmp_path, orchestrator={"max_staleness": 2})
    for i in range(5):
        async_orch.in_flight[f"p{i}"] = Attempt(i, 0.0)
    assert async_orch._issuable() == 1  # (0 + 2 + 1) x 2 = 6, 5 outstanding
    async_orch.in_flight["p5"] = Attempt(5, 0.0)
    assert async_orch._issuable() == 0


def test_dynamic_sampling_filters_groups_whose_rewards_do_not_vary(tmp_path):
    orch = orchestrator(tmp_path, algorithm={"dynamic_sampling": True})
    complete(orch, 0, 0, rewards=(1.0, 1.0))
    complete(orch, 1, 0, rewards=(0.1, 1.1))
    assert [g.request_id for g in orch.buffered] == ["p1"] and orch.counts["filtered_groups"] == 1
    assert b"moerl_samples_filtered_total 2.0" in orch.metrics.exposition()


def test_a_late_duplicate_of_a_hedged_request_is_ignored(tmp_path):
    orch = orchestrator(tmp_path)
    complete(orch, 0, 0)
    orch._completed(Group("p0", 0, [1, 4], 0, []))  # the straggler's answer arrives after the hedge's
    assert len(orch.buffered) == 1 and orch.counts["duplicates_ignored"] == 1


def test_dns_endpoints_expand_to_every_address_and_plain_urls_stay():
    assert expand_endpoint("http://10.0.0.7:8000/") == ["http://10.0.0.7:8000"]
    assert expand_endpoint("dns+http://localhost:8000") == ["http://127.0.0.1:8000"]
    with pytest.raises(ValueError, match="dns\\+http://<name>:<port>"):
        expand_endpoint("dns+http://localhost")


def test_servers_follow_the_endpoints_resolution(tmp_path):
    orch = orchestrator(tmp_path)
    assert list(orch.servers) == ["http://127.0.0.1:9"]
    orch.endpoints = ["dns+http://localhost:8001", "http://127.0.0.2:8002"]
    orch._discover()
    assert sorted(orch.servers) == ["http://127.0.0.1:8001", "http://127.0.0.2:8002"]


def test_state_round_trip_keeps_cursor_buffer_batches_and_reissues_in_flight_requests(tmp_path):
    import json

    orch = orchestrator(tmp_path)
    for index in range(3):
        complete(orch, index, 0)
    orch.next_prompt = 5
    orch.in_flight["p3"] = Attempt(3, 0.0, servers=["http://127.0.0.1:9"])  # p4 was lost with its server earlier
    batch = orch.batch(step=0, committed=0, timeout=0.1)
    state = json.loads(json.dumps(orch.snapshot()))  # what a checkpoint stores
    restored = Orchestrator(orch.run, ["http://127.0.0.1:9"], None, state=state)
    assert restored.next_prompt == 5 and restored.consumed == 2
    assert restored.batch(step=0, committed=0, timeout=0.1) == batch  # a resumed trainer sees the same batch
    assert [g.request_id for g in restored.buffered] == ["p2"]
    assert list(restored.retry) == ["p3"] and restored.in_flight["p3"].prompt_index == 3


def test_queue_depth_counts_in_flight_and_what_the_budget_allows_but_no_server_took(tmp_path):
    orch = orchestrator(tmp_path, orchestrator={"max_staleness": 1})
    # trainer at version 0, max_staleness 1, 2 prompts per step: 4 groups may be outstanding
    assert orch.queue_depth() == 4
    orch.in_flight["p0"] = Attempt(0, 0.0)
    complete(orch, 1, 0)
    assert orch.queue_depth() == 1 + 2  # one in flight, one buffered, two more allowed


def test_resume_latest_reads_the_newest_checkpoint_or_starts_fresh(tmp_path):
    assert resume_state("latest", tmp_path) is None  # no checkpoint yet
    (tmp_path / "checkpoints" / "step-00000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000010" / "orchestrator.json").write_text('{"next_prompt": 20}')
    (tmp_path / "checkpoints" / "LATEST").write_text("step-00000010")
    assert resume_state("latest", tmp_path) == {"next_prompt": 20}
    assert resume_state(str(tmp_path / "checkpoints" / "step-00000010" / "orchestrator.json"), tmp_path) == {"next_prompt": 20}
    assert resume_state(None, tmp_path) is None


def pool_of(tmp_path, loaded: str):
    """An orchestrator (budget: (0 + 2 + 1) x 2 = 6 requests) over servers a, b, c, of which only `loaded` holds
    the published version yet; returns it and the list its sends land in."""
    orch = orchestrator(tmp_path, orchestrator={"max_staleness": 2})
    sent = []
    orch.pool = SimpleNamespace(submit=lambda fn, request_id, index, server: sent.append(server.url))
    orch.servers = {url: Server(url, healthy=True, version=0) for url in ("a", "b", "c")}
    orch.published = 1
    orch.servers[loaded].version = 1
    return orch, sent


def test_a_burst_spreads_over_the_pool_even_while_servers_still_load_the_new_version(tmp_path):
    orch, sent = pool_of(tmp_path, loaded="c")
    orch._issue_new()
    assert sent == ["c", "c"]  # its share of the 6 over 3 healthy servers, not all 6
    for url in ("a", "b"):
        orch.servers[url].version = 1
    orch._issue_new()
    assert sorted(sent) == ["a", "a", "b", "b", "c", "c"] and len(orch.in_flight) == 6


def test_a_server_whose_load_failed_releases_its_share(tmp_path):
    orch, sent = pool_of(tmp_path, loaded="c")
    orch.servers["a"].healthy = orch.servers["b"].healthy = False  # their weight loads failed
    orch._issue_new()
    assert sent == ["c"] * 6
