"""The orchestrator through its public seams: the pure group buffer (staleness budget, stale and failed groups
dropped and counted, batches idempotent by step and in prompt order, lineage), the server pool (choice, fair
share, discovery), and the driver against HTTP endpoints that answer like rollout servers (4xx everywhere,
failures after the reply, stragglers hedged and their losers cancelled, restarts that must not train a dead
lineage's samples)."""
import asyncio
import json

import pytest
from rl_helpers import tiny_run

from moe_rl_eks.workloads.orchestrator.app import build, resume_state
from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer, StepConflict
from moe_rl_eks.workloads.orchestrator.pool import ServerPool, expand_endpoint
from moe_rl_eks.workloads.orchestrator.state_file import read_state
from moe_rl_eks.workloads.rl.protocol import (Group, OrchestratorState, PromptRecord, Sample, VersionRef, VersionSpan,
                                              one_version, sample_staleness)

GRPO = lambda rewards: [r - sum(rewards) / len(rewards) for r in rewards]  # centred: enough to check placement


def prompt(i):
    return PromptRecord(i, [1, 4], "1+1=", "2")


def group(i, version, rewards=(1.0, 0.0), lineage=0):
    samples = [Sample([5, 2], [-1.0, -0.5], r, True, one_version(VersionRef(lineage, version), 2)) for r in rewards]
    return Group(f"p{i}", i, [1, 4], VersionRef(lineage, version), samples)


def complete(buf, i, version, rewards=(1.0, 0.0), lineage=0, failed=0, dynamic=False):
    buf.issue(prompt(i))
    return buf.complete(group(i, version, rewards, lineage), rewards_failed=failed, dynamic_sampling=dynamic).kind


# ---- the buffer ---------------------------------------------------------------------------------------------
def test_groups_too_stale_for_the_step_or_from_its_future_are_dropped_and_counted():
    buf = GroupBuffer(prompts_per_step=2, max_staleness=1, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 2))
    for index, version in [(3, 2), (0, 0), (4, 3), (1, 1), (2, 2)]:
        complete(buf, index, version)
    dropped = buf.drop_stale(2, 0)
    # version 0 lags step 2 by 2 > max_staleness 1; version 3 is newer than the step (negative staleness)
    assert sorted(g.request_id for g in dropped) == ["p0", "p4"] and buf.counts["dropped_stale_groups"] == 2
    batch = buf.batch(2, 0, 0, GRPO)
    assert [s.id for s in batch.samples] == ["p1/0", "p1/1", "p3/0", "p3/1"]  # arrival order, sorted by prompt
    assert batch.stats.staleness_mean == 0.5 and batch.stats.reward_mean == 0.5 and batch.stats.accuracy == 0.5
    assert [s.advantage for s in batch.samples[:2]] == [0.5, -0.5]
    assert buf.batch(2, 0, 0, GRPO) is batch  # a restarted trainer gets the same batch
    assert buf.batch(3, 0, 0, GRPO) is None  # one group left, two needed
    with pytest.raises(StepConflict, match="step 5: the next batch to form is step 3"):
        buf.batch(5, 0, 0, GRPO)
    with pytest.raises(StepConflict, match="step 2: its batch was forgotten"):
        buf.batch(2, 0, 3, GRPO)  # committed 3: batch 2 is gone, a trainer asking for it again cannot get it


def test_a_group_is_as_stale_as_its_oldest_token_and_is_dropped_whole_when_one_token_is_too_old():
    buf = GroupBuffer(prompts_per_step=1, max_staleness=1, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 3))
    swapped = [VersionSpan(0, 1, 1), VersionSpan(0, 2, 1)]  # its server swapped version 2 in after one token
    for i, spans in [(0, swapped), (1, [VersionSpan(0, 2, 1), VersionSpan(0, 3, 1)])]:
        buf.issue(prompt(i))
        samples = [Sample([5, 2], [-1.0, -0.5], 1.0, True, spans),
                   Sample([6, 2], [-1.0, -0.5], 0.0, True, one_version(VersionRef(0, 3), 2))]
        buf.complete(Group(f"p{i}", i, [1, 4], spans[0].ref, samples), rewards_failed=0, dynamic_sampling=False)
    # p0's first token (version 1) lags step 3 by 2 > 1, although its other token and its other sample are fresh
    assert [g.request_id for g in buf.drop_stale(3, 0)] == ["p0"]
    batch = buf.batch(3, 0, 0, GRPO)
    assert [s.versions for s in batch.samples] == [[VersionSpan(0, 2, 1), VersionSpan(0, 3, 1)],
                                                   one_version(VersionRef(0, 3), 2)]
    assert batch.stats.staleness_mean == 0.5  # per sample, by its oldest token: (1 + 0) / 2


def test_no_new_prompt_beyond_the_staleness_budget_and_none_before_the_trainer_posts():
    buf = GroupBuffer(prompts_per_step=2, max_staleness=0, correct_reward=1.0)
    assert buf.budget_left() == 0  # no trainer version yet: nothing may be sampled
    buf.set_trainer(VersionRef(0, 0))
    assert buf.budget_left() == 2
    complete(buf, 0, 0)
    buf.issue(prompt(1))
    assert buf.budget_left() == 0 and buf.demand() == 1
    buf.set_trainer(VersionRef(0, 1000))  # no trainer can be past step 0, the next batch to form: budget unmoved
    assert buf.budget_left() == 0
    buf.complete(group(1, 0), rewards_failed=0, dynamic_sampling=False)
    assert buf.batch(0, 0, 0, GRPO) is not None
    assert buf.budget_left() == 2  # step 1's two groups: counted as version 1, the next batch to form
    async_buf = GroupBuffer(prompts_per_step=2, max_staleness=2, correct_reward=1.0)
    async_buf.set_trainer(VersionRef(0, 0))
    for i in range(5):
        async_buf.issue(prompt(i))
    assert async_buf.budget_left() == 1  # (0 + 2 + 1) x 2 = 6, 5 outstanding


def test_failed_rewards_are_masked_and_a_group_left_with_fewer_than_two_is_dropped():
    buf = GroupBuffer(prompts_per_step=1, max_staleness=0, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 0))
    assert complete(buf, 0, 0, rewards=(1.0,), failed=3) == "too_few"
    assert complete(buf, 1, 0, rewards=(1.0, 0.0), failed=2) == "kept"
    assert buf.counts["rewards_failed"] == 5 and buf.counts["dropped_failed_groups"] == 1
    assert buf.batch(0, 0, 0, GRPO).stats.rewards_failed == 5


def test_dynamic_sampling_filters_groups_whose_rewards_do_not_vary_and_late_duplicates_are_ignored():
    buf = GroupBuffer(prompts_per_step=2, max_staleness=0, correct_reward=1.0)
    assert complete(buf, 0, 0, rewards=(1.0, 1.0), dynamic=True) == "filtered"
    assert complete(buf, 1, 0, rewards=(0.1, 1.1), dynamic=True) == "kept"
    assert buf.complete(group(1, 0), rewards_failed=0, dynamic_sampling=True).kind == "duplicate"
    assert buf.counts["filtered_groups"] == 1 and buf.counts["duplicates_ignored"] == 1


def test_a_new_lineage_trains_its_shared_history_but_never_the_dead_lineages_later_versions():
    buf = GroupBuffer(prompts_per_step=2, max_staleness=2, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 3))
    for i, v in enumerate([3, 3, 3, 2]):
        complete(buf, i, v)
    assert buf.batch(3, 0, 0, GRPO) is not None
    buf.set_trainer(VersionRef(0, 5))  # the dead trainer went on to version 5 and fetched batch 4 ...
    assert [s.versions for s in buf.batch(4, 0, 0, GRPO).samples] == [one_version(VersionRef(0, 3), 2)] * 2 + [
        one_version(VersionRef(0, 2), 2)] * 2
    for i, v in [(4, 5), (5, 4)]:  # ... while servers sampled its versions 4 and 5
        complete(buf, i, v)
    state = OrchestratorState.from_json(json.loads(json.dumps(buf.snapshot().to_json())))
    # restart from the checkpoint of step 3: a new orchestrator, a trainer of lineage 1 resumed at version 3
    new = GroupBuffer.restore(state, prompts_per_step=2, max_staleness=2, correct_reward=1.0)
    assert new.set_trainer(VersionRef(1, 3)) and new.forks == {1: VersionRef(0, 3)}
    assert new.revalidate(3, 1) == []  # batch 3 was sampled with versions <= 3: the shared history
    assert new.batch(3, 1, 3, GRPO).samples == buf.batches[3].samples and new.batches[3].lineage == 1
    # batch 4 holds version-3 samples too (max_staleness 2): still in the shared history, so it is kept
    assert new.revalidate(4, 1) == []
    dropped = new.drop_stale(5, 1)  # versions 4 and 5 of lineage 0 never existed for lineage 1
    assert sorted(g.request_id for g in dropped) == ["p4", "p5"]
    for i, v in [(6, 3), (7, 4)]:
        complete(new, i, v, lineage=1)
    assert {s.versions[0].ref for s in new.batch(5, 1, 3, GRPO).samples} == {VersionRef(1, 3), VersionRef(1, 4)}


def test_a_dead_lineages_batch_outside_the_new_history_is_dropped_and_formed_again():
    buf = GroupBuffer(prompts_per_step=1, max_staleness=1, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 4))
    complete(buf, 0, 4)
    buf.batch(4, 0, 0, GRPO)
    complete(buf, 1, 4)
    buf.batch(5, 0, 0, GRPO)
    buf.set_trainer(VersionRef(1, 3))  # resumed from step 3: version 4 of lineage 0 is dead
    assert buf.revalidate(4, 1) == ["p0", "p1"] and buf.batches == {} and buf.consumed == 0
    assert buf.counts["dropped_stale_groups"] == 2


def test_state_round_trip_keeps_cursor_buffer_batches_and_reissues_in_flight_prompts():
    buf = GroupBuffer(prompts_per_step=2, max_staleness=1, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 0))
    for i in range(3):
        complete(buf, i, 0)
    buf.issue(prompt(3))
    batch = buf.batch(0, 0, 0, GRPO)
    state = OrchestratorState.from_json(json.loads(json.dumps(buf.snapshot().to_json())))
    restored = GroupBuffer.restore(state, prompts_per_step=2, max_staleness=1, correct_reward=1.0)
    assert restored.next_prompt == 4 and restored.consumed == 2
    assert restored.batch(0, 0, 0, GRPO) == batch
    assert [g.request_id for g in restored.buffered] == ["p2"] and list(restored.in_flight) == ["p3"]
    assert restored.budget_left() == 0  # nothing is sampled until the restarted trainer posts its version


def test_resume_latest_reads_the_newest_checkpoint_or_starts_fresh(tmp_path):
    assert resume_state("latest", tmp_path) is None
    state = GroupBuffer(1, 0, 1.0).snapshot()
    (tmp_path / "checkpoints" / "step-00000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000010" / "orchestrator.json").write_text(json.dumps(state.to_json()))
    (tmp_path / "checkpoints" / "LATEST").write_text("step-00000010")
    assert resume_state("latest", tmp_path) == state
    (tmp_path / "bad.json").write_text('{"format": 2, "next_prompt": "x"}')
    with pytest.raises(ValueError, match=r"bad.json.next_prompt: 'x' is not allowed; expected an integer"):
        resume_state(str(tmp_path / "bad.json"), tmp_path)


# ---- the pool -----------------------------------------------------------------------------------------------
def test_a_burst_spreads_over_the_pool_even_while_servers_still_load_the_new_version():
    pool = ServerPool(["http://a", "http://b", "http://c"], max_in_flight=16)
    new = VersionRef(0, 1)
    for url in pool.urls():
        pool.healthy(url, 0, 0)
    pool.healthy("http://c", 1, 0)
    sent = [pool.acquire(new.__eq__, demand=6 - i) for i in range(6)]
    assert sent == ["http://c", "http://c", None, None, None, None]  # its share of 6 over 3 healthy servers
    pool.healthy("http://a", 1, 0)
    pool.unhealthy("http://b")  # a server whose load failed releases its share
    assert pool.acquire(new.__eq__, demand=4) == "http://a"
    pool.release("http://c")
    assert {v.url: v.in_flight for v in pool.view()} == {"http://a": 1, "http://b": 0, "http://c": 1}


def test_requests_go_to_any_server_within_the_staleness_bound_the_newest_first_among_equals():
    buf = GroupBuffer(prompts_per_step=1, max_staleness=1, correct_reward=1.0)
    assert not buf.usable(VersionRef(0, 0))  # no trainer version yet: nothing may be sampled
    buf.set_trainer(VersionRef(0, 3))
    pool = ServerPool(["http://a", "http://b", "http://c", "http://d"], max_in_flight=4)
    for url, version in [("http://a", 1), ("http://b", 2), ("http://c", 3), ("http://d", 4)]:
        pool.healthy(url, version, 0)
    # a (version 1) lags by 2; d (version 4) is newer than the trainer (a dead lineage's, or a step not taken)
    assert [buf.usable(VersionRef(0, v)) for v in (1, 2, 3, 4)] == [False, True, True, False]
    sent = [pool.acquire(buf.usable) for _ in range(4)]
    assert sent == ["http://c", "http://b", "http://c", "http://b"]  # b still loads version 3: it gets work too
    buf.set_trainer(VersionRef(1, 2))  # a trainer restarted from step 2 of lineage 0: version 3 of it is dead
    assert buf.usable(VersionRef(0, 1)) and buf.usable(VersionRef(0, 2)) and not buf.usable(VersionRef(0, 3))
    assert pool.acquire(buf.usable) == "http://a"  # version 1 is within the bound of step 2, c's 3 never


def test_weight_pushes_go_once_to_each_healthy_server_that_lacks_the_version():
    pool = ServerPool(["http://a", "http://b"], max_in_flight=1)
    pool.healthy("http://a", 1, 0)
    pool.healthy("http://b", 2, 0)
    assert pool.needing(VersionRef(0, 2)) == ["http://a"] and pool.needing(VersionRef(0, 2)) == []
    pool.pushed("http://a", VersionRef(0, 2), loaded=False)  # refused: asked again at the next health check
    assert pool.needing(VersionRef(0, 2)) == ["http://a"]


def test_a_server_that_names_no_lineage_holds_the_one_last_loaded_into_it():
    pool = ServerPool(["http://a"], max_in_flight=1)
    pool.healthy("http://a", 3, None)
    assert pool.view()[0].holds is None and pool.needing(VersionRef(1, 3)) == ["http://a"]  # unknown: push
    pool.pushed("http://a", VersionRef(1, 3), loaded=True)
    pool.healthy("http://a", 3, None)
    assert pool.view()[0].holds == VersionRef(1, 3) and pool.attribute("http://a", VersionRef(0, 3)) == VersionRef(1, 3)
    pool.healthy("http://a", 4, None)  # it moved to a version we did not load: its answers are not attributed
    assert pool.view()[0].holds is None and pool.attribute("http://a", VersionRef(0, 4)) is None


def test_dns_endpoints_expand_to_every_address_and_plain_urls_stay():
    assert expand_endpoint("http://10.0.0.7:8000/") == ["http://10.0.0.7:8000"]
    assert expand_endpoint("dns+http://localhost:8000") == ["http://127.0.0.1:8000"]
    with pytest.raises(ValueError, match="dns\\+http://<name>:<port>"):
        expand_endpoint("dns+http://localhost")
    pool = ServerPool(["dns+http://localhost:8001", "http://127.0.0.2:8002"], max_in_flight=1)
    assert sorted(pool.urls()) == ["http://127.0.0.1:8001", "http://127.0.0.2:8002"]


# ---- the driver, against endpoints that answer like rollout servers -------------------------------------------
def orchestrator(tmp_path, urls, state=None, fallback=None, state_path=None, **sections):
    run = tiny_run(tmp_path, training={"prompts_per_step": 2}, algorithm={"group_size": 2}, **sections)
    return build(run, urls, token=None, events_path=tmp_path / "events.jsonl", state=state, fallback=fallback,
                 state_path=state_path)


async def until(predicate, timeout=20.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def test_requests_go_on_to_a_server_still_loading_the_new_version_while_its_weights_are_within_the_bound(
        tmp_path, fakes):
    servers = fakes(1)
    (server,) = servers.endpoints

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, orchestrator={"max_staleness": 1})
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        first = await orch.batch(0, 0, timeout_s=20)
        await until(lambda: server.completions == 4)  # the budget at trainer version 0: (0 + 1 + 1) x 2 groups
        server.loads_held = True
        await orch.publish(VersionRef(0, 1))  # the server does not answer its load: it still holds version 0
        await until(lambda: server.completions == 6)  # step 1's budget, sampled with version 0 (staleness 1)
        second = await orch.batch(1, 0, timeout_s=20)
        holds = server.holds
        server.loads_held = False
        await orch.stop()
        return orch, first, second, holds

    orch, first, second, holds = asyncio.run(scenario())
    assert holds == (0, 0) and {span.ref for s in second.samples for span in s.versions} == {VersionRef(0, 0)}
    assert second.stats.staleness_mean == 1.0 and first.stats.staleness_mean == 0.0
    value = orch.metrics.registry.get_sample_value
    # per token: 8 trained at staleness 0 (step 0), 8 at staleness 1 (step 1)
    assert value("moerl_sample_token_staleness_count") == 16 and value("moerl_sample_token_staleness_sum") == 8


def test_a_4xx_that_repeats_everywhere_fails_the_request_not_the_servers(tmp_path, fakes):
    servers = fakes(2, status=400)

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, orchestrator={"max_attempts": 3, "max_staleness": 0})
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        await until(lambda: orch.buffer.counts["failed_requests"] >= 2)
        healthy = [v.healthy for v in orch.pool.view()]
        await orch.stop()
        return orch, healthy, orch.pool.view()

    orch, healthy, views = asyncio.run(scenario())
    assert healthy == [True, True] and all(v.in_flight == 0 for v in views)
    assert sum(e.completions for e in servers.endpoints) == 0 and orch.buffer.counts["retries"] >= 4


def test_an_exception_after_the_reply_loses_the_request_but_leaks_no_in_flight_count(tmp_path, fakes):
    servers = fakes(1)

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, orchestrator={"max_staleness": 0})
        scorer, calls = orch.score_many, []

        def broken_twice(items):
            calls.append(1)
            if len(calls) <= 2:
                raise RuntimeError("scorer bug")
            return scorer(items)

        orch.score_many = broken_twice
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        batch = await orch.batch(0, 0, timeout_s=20)  # from the two prompts issued after the two lost ones
        views = orch.pool.view()  # the budget is spent: nothing is in flight any more, and nothing leaked
        counts = dict(orch.buffer.counts)
        await orch.stop()
        return batch, views, counts

    batch, (view,), counts = asyncio.run(scenario())
    assert view.in_flight == 0 and view.healthy and counts["failed_requests"] == 2
    assert sorted({s.id.split("/")[0] for s in batch.samples}) == ["p2", "p3"]


def test_a_straggler_is_hedged_once_sent_and_the_loser_cancelled_by_closing_its_connection(tmp_path, fakes):
    slow, fast = fakes(1, delay_s=30.0), fakes(1)

    async def scenario():
        orch = orchestrator(tmp_path, slow.urls + fast.urls,
                            orchestrator={"max_staleness": 0, "straggler_after_s": 0.3, "request_timeout_s": 60})
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        batch = await orch.batch(0, 0, timeout_s=20)
        await until(lambda: slow.endpoints[0].cancelled >= 1)
        counts = dict(orch.buffer.counts)
        await orch.stop()
        return batch, counts

    batch, counts = asyncio.run(scenario())
    assert len(batch.samples) == 4 and counts["hedges"] >= 1 and counts["failed_requests"] == 0
    assert slow.endpoints[0].completions == 0 and slow.endpoints[0].cancelled >= 1


def test_restarting_orchestrator_and_trainer_while_servers_hold_newer_versions_trains_no_dead_sample(tmp_path, fakes):
    """Bug 1: a trainer resumed at checkpoint 3 while the servers hold version 5 of the dead lineage."""
    servers = fakes(2)

    async def first_life():
        orch = orchestrator(tmp_path, servers.urls, orchestrator={"max_staleness": 1})
        await orch.start()
        checkpoint = None
        for step in range(6):
            await orch.publish(VersionRef(0, step))
            assert await orch.batch(step, 0, timeout_s=20) is not None
            if step == 3:
                checkpoint = orch.snapshot().to_json()  # what the trainer's checkpoint of step 3 stores
        await orch.publish(VersionRef(0, 6))
        await until(lambda: all(e.holds == (0, 6) for e in servers.endpoints))
        await orch.stop()
        return checkpoint

    checkpoint = asyncio.run(first_life())
    for e in servers.endpoints:
        # each server's first answers after the push still come from version (0, 6): its swap is in progress
        e.delay_s, e.lag = 0.05, 3

    async def second_life():
        state = OrchestratorState.from_json(json.loads(json.dumps(checkpoint)))
        orch = orchestrator(tmp_path, servers.urls, state=state, orchestrator={"max_staleness": 1})
        await orch.start()
        await asyncio.sleep(1.0)  # health checks see version (0, 6); nothing is sampled before the trainer posts
        assert orch.buffer.in_flight.keys() == {f"p{p.index}" for p in state.pending}
        batches = []
        for step in range(3, 8):
            await orch.publish(VersionRef(1, step))
            batch = await orch.batch(step, 3, timeout_s=20)
            assert batch is not None
            batches.append(batch)
        counts = dict(orch.buffer.counts)
        await orch.stop()
        return batches, counts

    batches, counts = asyncio.run(second_life())
    history = {VersionRef(0, v) for v in range(4)}
    for b in batches:
        for s in b.samples:
            for span in s.versions:  # every token's weights
                assert span.lineage == 1 or span.ref in history, (b.step, s.id, span)
                assert 0 <= b.step - span.version <= 1
    assert all(e.loads[-1][0] == 1 for e in servers.endpoints)  # every server was moved to the new lineage
    assert counts["dropped_stale_groups"] >= 1  # samples of (0, 6) arrived, and were not trained
    seen = [s.id for b in batches for s in b.samples]
    assert len(seen) == len(set(seen))


def test_a_request_past_its_deadline_is_retried_with_a_new_seed_and_leaves_the_server_healthy(tmp_path, fakes):
    """3 tokens at the declared floor of 3 tokens/s plus 0.3 s: a 1.3 s deadline. The first answer takes 5 s."""
    server = fakes(1, first_delays=[5.0])

    async def scenario():
        orch = orchestrator(tmp_path, server.urls, rollout={"min_row_tokens_per_s": 3.0},
                            orchestrator={"max_staleness": 0, "straggler_after_s": 0.3, "request_timeout_s": 60})
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        batch = await orch.batch(0, 0, timeout_s=20)
        await until(lambda: server.endpoints[0].cancelled >= 1)
        counts, (view,) = dict(orch.buffer.counts), orch.pool.view()
        await orch.stop()
        return batch, counts, view

    batch, counts, view = asyncio.run(scenario())
    seeds = server.endpoints[0].seeds
    assert counts["deadline_misses"] == 1 and counts["failed_requests"] == 0 and view.healthy
    assert len(batch.samples) == 4 and len(seeds) == 3 and len(set(seeds)) == 3  # the retry drew its own seed


def test_a_servers_measured_rate_sets_when_its_requests_count_as_stragglers(tmp_path, fakes):
    """At 1 token/s per row a 3-token request is expected to take 3 s: no hedge at 1 s; at 100 tokens/s it would
    have been hedged after the 0.3 s allowance."""
    slow, fast = fakes(1, delay_s=1.0, row_tokens_per_s=1.0), fakes(1)

    async def scenario():
        orch = orchestrator(tmp_path, slow.urls + fast.urls, rollout={"min_row_tokens_per_s": 1.0},
                            orchestrator={"max_staleness": 0, "straggler_after_s": 0.3, "request_timeout_s": 60})
        await orch.start()
        await until(lambda: orch.pool.row_rate(slow.urls[0]) == 1.0)
        await orch.publish(VersionRef(0, 0))
        batch = await orch.batch(0, 0, timeout_s=20)
        counts = dict(orch.buffer.counts)
        await orch.stop()
        return batch, counts

    batch, counts = asyncio.run(scenario())
    assert len(batch.samples) == 4 and counts["hedges"] == 0 and counts["deadline_misses"] == 0


def first_life_persisting_every_step(tmp_path, servers, steps, checkpoint_at):
    """An orchestrator that serves `steps` batches of lineage 0 and is then dropped (as if SIGKILLed: nothing
    written at exit); returns its state file's path, the checkpoint's state of step `checkpoint_at`, and the ids
    served."""
    path = tmp_path / "orchestrator-state.json"

    async def life():
        orch = orchestrator(tmp_path, servers.urls, state_path=path, orchestrator={"max_staleness": 1})
        await orch.start()
        served, checkpoint = [], None
        for step in range(steps):
            await orch.publish(VersionRef(0, step))
            served += [s.id for s in (await orch.batch(step, 0, timeout_s=20)).samples]
            assert read_state(path).batches.keys() == set(range(step + 1))  # written before it was served
            if step == checkpoint_at:
                checkpoint = orch.snapshot()
        await orch.stop()
        return checkpoint, served

    return (path, *asyncio.run(life()))


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_an_orchestrator_restarted_alone_continues_from_its_own_state_and_serves_at_the_first_post(
        tmp_path, fakes, with_checkpoint):
    servers = fakes(2)
    path, checkpoint, served = first_life_persisting_every_step(tmp_path, servers, steps=4, checkpoint_at=1)

    async def second_life():
        orch = orchestrator(tmp_path, servers.urls, state=read_state(path),
                            fallback=checkpoint if with_checkpoint else None, state_path=path,
                            orchestrator={"max_staleness": 1})
        await orch.start()
        assert await orch.batch(4, 1, timeout_s=20) is None  # at once: no version held, the trainer must post
        await orch.publish(VersionRef(0, 4))  # the living trainer's re-post of its version
        batch = await orch.batch(4, 1, timeout_s=20)
        restarts = orch.buffer.counts["restarts"]
        await orch.stop()
        return batch, restarts

    batch, restarts = asyncio.run(second_life())
    assert batch.step == 4 and restarts == 1
    ids = [s.id for s in batch.samples]
    assert not set(ids) & set(served)  # the checkpoint's older state was not taken: nothing served twice
    assert all(0 <= sample_staleness(4, s.versions) <= 1 for s in batch.samples)


def test_a_trainer_resuming_in_a_new_lineage_makes_the_restarted_orchestrator_take_the_checkpoints_state(
        tmp_path, fakes):
    servers = fakes(2)
    path, checkpoint, served = first_life_persisting_every_step(tmp_path, servers, steps=4, checkpoint_at=1)

    async def second_life():
        orch = orchestrator(tmp_path, servers.urls, state=read_state(path), fallback=checkpoint, state_path=path,
                            orchestrator={"max_staleness": 1})
        await orch.start()
        await orch.publish(VersionRef(1, 2))  # resumed from the checkpoint of step 1 (it trains step 2 next)
        batch = await orch.batch(2, 2, timeout_s=20)
        consumed = orch.buffer.consumed
        await orch.stop()
        return batch, consumed

    batch, consumed = asyncio.run(second_life())
    assert checkpoint.consumed == 2 * 2 and consumed == 3 * 2  # batches 0..2 from the checkpoint's cursor
    # batch 2 formed again from the checkpoint's groups and prompts (same seeds): the dead trainer's batch 2
    assert [s.id for s in batch.samples] == served[8:12]


def test_the_trainers_source_reposts_its_version_to_a_restarted_orchestrator_and_gets_the_next_batch(
        tmp_path, fakes):
    """Through the HTTP seams both sides use: the first orchestrator serves batches 0 and 1 to the trainer's
    HttpBatchSource and dies; one started on the same port from its state file answers the next poll with no
    version held, the source re-posts version 2, and the poll after that gets batch 2."""
    from moe_rl_eks.workloads.orchestrator.app import make_app
    from moe_rl_eks.workloads.rl.runtime import BackgroundServer
    from moe_rl_eks.workloads.trainer.orchestrator_link import HttpBatchSource

    servers, path = fakes(2), tmp_path / "orchestrator-state.json"

    def serve(state, port=0):
        orch = orchestrator(tmp_path, servers.urls, state=state, state_path=path, orchestrator={"max_staleness": 0})
        return BackgroundServer(make_app(orch, batch_poll_s=5.0), port=port).start()

    first = serve(None)
    source = HttpBatchSource(first.url)
    trained = []
    for step in range(2):
        source.version_published(step, 0)
        trained += [s.id for s in source.next_batch(step, 0, lambda: False).samples]
    source.version_published(2, 0)
    first.stop()  # its state file holds batches 0 and 1: nothing of it is written at exit
    second = serve(read_state(path), port=first.port)
    try:
        batch = source.next_batch(2, 0, lambda: False)
    finally:
        second.stop()
    assert source.reannounced == 1 and batch.step == 2
    assert not {s.id for s in batch.samples} & set(trained)
    # synchronous: every token sampled with the re-posted version
    assert all([v.ref for v in s.versions] == [VersionRef(0, 2)] for s in batch.samples)


def test_a_refused_batch_request_drops_no_group_and_forgets_no_batch(tmp_path, fakes):
    servers = fakes(1)

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, orchestrator={"max_staleness": 2})
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        assert await orch.batch(0, 0, timeout_s=20) is not None
        await until(lambda: len(orch.buffer.buffered) >= 2)  # the budget's later groups wait for steps 1 and 2
        await orch.stop()  # nothing moves now but the requests below
        before = orch.snapshot()
        refusals = []
        for step, committed in [(7, 0), (0, 1), (1, 5)]:  # past the next batch; forgotten; committed past it
            with pytest.raises(StepConflict) as refused:
                await orch.batch(step, committed, timeout_s=0)
            refusals.append(str(refused.value))
        return before, orch.snapshot(), refusals

    before, after, refusals = asyncio.run(scenario())
    assert after == before  # no group dropped as stale for step 7, batch 0 not forgotten
    assert refusals[0].startswith("step 7: the next batch to form is step 1; ask for that one (a trainer past it")
    assert refusals[2].startswith("step 1: its batch was forgotten or would be (committed=5")
