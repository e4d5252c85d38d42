"""An orchestrator restored from a checkpoint's older state (its own state file lost) while the trainer trained on:
the trainer's record of the batches it trained catches it up (GroupBuffer.catch_up, POST /v1/trained), no prompt
trains twice, and a record that does not fit is refused changing nothing. The process test is in test_faults.py."""
import asyncio
import dataclasses
import json
import re
import urllib.request

import pytest
from test_orchestrator import GRPO, complete, orchestrator, prompt

from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer, MalformedRecord, StepConflict
from moe_rl_eks.workloads.rl.checkpoint_dirs import LATEST, ORCHESTRATOR_STATE, final_dir
from moe_rl_eks.workloads.rl.data import BUILTIN_SOURCE
from moe_rl_eks.workloads.rl.protocol import OrchestratorState, VersionRef, request_of, sample_staleness


def checkpointed_buffer():
    """Batches 0 and 1 formed (p0..p3), p4 and p5 buffered, p6 and p7 in flight: a checkpoint's state at step 2."""
    buf = GroupBuffer(prompts_per_step=2, max_staleness=2, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 0))
    for i in range(6):
        complete(buf, i, 0)
        if i in (1, 3):
            buf.batch(i // 2, 0, 0, GRPO)
    buf.issue(prompt(6))
    buf.issue(prompt(7))
    return buf


def test_catching_up_takes_the_trained_prompts_out_of_what_waits_and_skips_those_not_yet_drawn():
    buf = checkpointed_buffer()
    # The lost state went on: step 2 trained p5 and p6, step 3 p4 and p9 (p8 was filtered, p7 still in flight).
    done = buf.catch_up({1: ["p2", "p3"], 2: ["p5", "p6"], 3: ["p4", "p9"]})
    assert done.next_step == 4 and done.cancelled == ["p6"] and [g.request_id for g in done.dropped] == ["p4", "p5"]
    assert buf.next_step() == 4 and buf.consumed == 8 and buf.counts["caught_up_steps"] == 2
    assert list(buf.in_flight) == ["p7"] and buf.buffered == [] and buf.trained_ahead == {9}
    assert buf.snapshot().trained_ahead == [9]  # persisted: a second restart still skips it
    drawn = [i for i in range(8, 12) if not buf.trained_already(i)]
    assert drawn == [8, 10, 11] and buf.trained_ahead == set()  # p8 is drawn again: it never trained
    buf.check_step(4, 0)  # the trainer's step is the next to form now
    assert buf.catch_up({2: ["p5", "p6"], 3: ["p4", "p9"]}).next_step == 4  # the same record again: nothing to do
    assert buf.counts["caught_up_steps"] == 2


@pytest.mark.parametrize("record, refused, message", [
    ({3: ["p6", "p7"]}, StepConflict, r"record begins at step 3 and this state ends before step 2: steps 2\.\.2"),
    ({1: ["p2", "p9"], 2: ["p5", "p6"]}, StepConflict, r"step 1: the trainer's record of its batch is not the batch"),
    ({2: ["p5"]}, StepConflict, r"trained\[2\]: 1 request ids .* prompts_per_step = 2"),
    ({2: ["p5", "p6"], 3: ["p6", "p9"]}, StepConflict, r"request p6: the record trains it at two steps"),
    ({2: ["p1", "p6"]}, StepConflict, r"request p1: .*a prompt trains once"),  # p1 trained at step 0
    ({2: ["p5", "x"]}, MalformedRecord, r"trained\[2\]: 'x' is no request id"),
    ({2: ["p5", "p06"]}, MalformedRecord, r"'p06' is no request id"),
    ({2: ["p5", "p6"], 4: ["p8", "p9"]}, MalformedRecord, r"consecutive steps"),
    ({2: ["p5", "p6"], 10**30: ["p8", "p9"]}, MalformedRecord, r"consecutive steps"),
], ids=["gap", "another-runs-batch", "short", "twice", "held", "not-an-id", "not-its-spelling", "holes", "huge"])
def test_a_record_that_does_not_fit_the_state_is_refused_and_changes_nothing(record, refused, message):
    buf = checkpointed_buffer()
    before = buf.snapshot()
    with pytest.raises(refused, match=message):
        buf.catch_up(record)
    assert buf.snapshot() == before


def catch_up_metrics(url: str) -> dict[str, float]:
    """The orchestrator's catch-up series on its /metrics (Prometheus text), by series name with labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    series = re.findall(r"^(moerl_orchestrator_ca\w+_total\S*) (\S+)$", text, re.M)
    return {name: float(value) for name, value in series}


def first_life_then_a_lost_state_file(tmp_path, servers, checkpoint_at: int, committed=lambda step: 0,
                                      on_disk: int | None = None):
    """The first orchestrator serves batches 0..5 to a trainer's HttpBatchSource (the trainer's committed step
    at each: `committed(step)`), its /v1/state before step `checkpoint_at` is the checkpoint's (and the one before
    step `on_disk`, if given, the run's newest trainer checkpoint's on disk); it dies and its state file is lost.
    Returns the source, the ids trained by step, and (orchestrator, server) started on the same port from the
    checkpoint's state alone."""
    from moe_rl_eks.workloads.orchestrator.app import make_app
    from moe_rl_eks.workloads.rl.runtime import BackgroundServer
    from moe_rl_eks.workloads.trainer.orchestrator_link import HttpBatchSource

    path = tmp_path / "orchestrator-state.json"

    def serve(state, port=0):
        orch = orchestrator(tmp_path, servers.urls, state=state, state_path=path, orchestrator={"max_staleness": 1})
        return orch, BackgroundServer(make_app(orch, batch_poll_s=5.0), port=port).start()

    orch, first = serve(None)
    source = HttpBatchSource(first.url)
    trained, checkpoint = {}, None
    for step in range(6):
        if step == checkpoint_at:
            checkpoint = OrchestratorState.from_json(source.state())
        if step == on_disk:
            newest = final_dir(orch.checkpoints, step)
            newest.mkdir(parents=True)
            (newest / ORCHESTRATOR_STATE).write_text(json.dumps(source.state()))
            (orch.checkpoints / LATEST).write_text(newest.name)
        source.version_published(step, 0)
        trained[step] = [s.id for s in source.next_batch(step, committed(step), lambda: False).samples]
    source.version_published(6, 0)
    first.stop()
    path.unlink()  # a fresh volume: only the checkpoint's state is left
    return source, trained, serve(checkpoint, port=first.port)


def test_an_orchestrator_restored_from_an_older_state_catches_up_to_the_trainers_record_over_http(tmp_path, fakes):
    """Through the HTTP seams both sides use: restored from the checkpoint's state of step 2, the orchestrator
    refuses step 6 (its next batch is 2), takes the source's record of steps 0..5, and serves 6 and 7 with no
    prompt the trainer trained. A trainer then restarted from the checkpoint
    (lineage 1) gets the state as it was before the catch-up, and step 2 again."""
    from moe_rl_eks.workloads.trainer.orchestrator_link import HttpBatchSource

    source, trained, (orch, second) = first_life_then_a_lost_state_file(tmp_path, fakes(2), checkpoint_at=2)
    try:
        later = {}
        for step in (6, 7):
            batch = source.next_batch(step, 0, lambda: False)
            later[step] = batch
            source.version_published(step + 1, 0)
        caught_up = orch.buffer.counts["caught_up_steps"]
        assert orch.buffer.next_step() == 8 and OrchestratorState.from_json(source.state()).first_step == 0
        restarted = HttpBatchSource(second.url)  # the trainer died and resumed from its checkpoint of step 2
        restarted.version_published(2, 1)
        again = restarted.next_batch(2, 2, lambda: False)
        restarts = orch.buffer.counts["restarts"]
        metrics = catch_up_metrics(second.url)
    finally:
        second.stop()
    assert caught_up == 4 and source.reannounced >= 1 and restarts == 1  # a state replaced, not another start
    assert metrics == {'moerl_orchestrator_catch_ups_total{state="own"}': 1.0,
                       "moerl_orchestrator_caught_up_steps_total": 4.0}
    prompts_trained = {request_of(i) for ids in trained.values() for i in ids}
    for step, batch in later.items():
        assert batch.step == step and len({request_of(s.id) for s in batch.samples}) == 2
        assert not {request_of(s.id) for s in batch.samples} & prompts_trained
        assert all(0 <= sample_staleness(step, s.versions) <= 1 for s in batch.samples)
    assert not {request_of(s.id) for s in later[6].samples} & {request_of(s.id) for s in later[7].samples}
    # the state before the catch-up, restored for the trainer's new lineage: step 2 from the checkpoint's cursor
    assert again.step == 2 and again.lineage == 1
    assert not {request_of(s.id) for s in again.samples} & {request_of(i) for i in trained[0] + trained[1]}


def test_a_trainer_whose_record_begins_after_the_restored_state_fails_naming_both_refusals(tmp_path, fakes):
    """The source keeps its record from the committed step before the newest on (here 2, with 4 the newest): an
    orchestrator restored from a state of step 1 lacks step 1 from both, and with no checkpoint state on disk to
    take instead (an orchestrator not sharing the run's output), the trainer fails, saying so."""
    source, _, (orch, second) = first_life_then_a_lost_state_file(tmp_path, fakes(1), checkpoint_at=1,
                                                                  committed=lambda step: step // 2 * 2)
    try:
        assert sorted(source.trained) == [2, 3, 4, 5]
        with pytest.raises(RuntimeError, match=r"refused the batch request: 409 .*next batch to form is step 1.*; "
                                               r"our record of steps 2\.\.5 was refused too: 409 .*steps 1\.\.1 are "
                                               r"known to neither, and the run has no checkpoint state"):
            source.next_batch(6, 4, lambda: False)
        assert orch.buffer.next_step() == 1 and orch.buffer.counts["caught_up_steps"] == 0
        assert catch_up_metrics(second.url) == {}  # a refused record is no catch-up
    finally:
        second.stop()


def test_an_orchestrator_resumed_from_a_state_older_than_the_trainers_record_adopts_the_newest_checkpoint(
        tmp_path, fakes, caplog):
    """Restored from a state of step 1 (an explicit older --resume path) while the trainer's record covers 2..5:
    the orchestrator takes the run's newest checkpoint's state (step 4) instead, catches it up to step 6 from the
    record, says so, and the trainer goes on at steps 6 and 7 with no prompt trained twice."""
    source, trained, (orch, second) = first_life_then_a_lost_state_file(
        tmp_path, fakes(1), checkpoint_at=1, committed=lambda step: step // 2 * 2, on_disk=4)
    try:
        with caplog.at_level("WARNING", logger="moe_rl_eks.workloads.orchestrator.driver"):
            later = {}
            for step in (6, 7):
                later[step] = source.next_batch(step, 4, lambda: False)
                source.version_published(step + 1, 0)
        counts = dict(orch.buffer.counts)
        metrics = catch_up_metrics(second.url)
    finally:
        second.stop()
    assert metrics == {'moerl_orchestrator_catch_ups_total{state="newest_checkpoint"}': 1.0,
                       "moerl_orchestrator_caught_up_steps_total": 2.0}
    assert counts["caught_up_steps"] == 2 and counts["restarts"] == 1  # 4..5 from the record, on the adopted state
    assert any("adopted the run's newest checkpoint state" in r.message and "(next step 4)" in r.message
               and "(next step 1)" in r.message and "steps 2..5" in r.message for r in caplog.records)
    prompts_trained = {request_of(i) for ids in trained.values() for i in ids}
    assert [later[s].step for s in (6, 7)] == [6, 7]
    seen = [request_of(x.id) for s in (6, 7) for x in later[s].samples]
    assert len(set(seen)) == 4 and not set(seen) & prompts_trained


def checkpointed_state():
    return dataclasses.replace(checkpointed_buffer().snapshot(), source={"kind": BUILTIN_SOURCE, "cursor": 8})


def test_a_trainer_resumed_from_a_checkpoint_past_the_catch_up_goes_on_from_the_caught_up_state(tmp_path, fakes):
    servers = fakes(2)

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, state=checkpointed_state(), orchestrator={"max_staleness": 2})
        await orch.start()
        await orch.publish(VersionRef(0, 4))
        assert await orch.catch_up({2: ["p5", "p6"], 3: ["p4", "p9"]}) == 4
        assert (await orch.batch(4, 2, timeout_s=20)).step == 4
        await orch.publish(VersionRef(1, 5))  # died after its checkpoint of step 5 (past the catch-up) was committed
        batch = await orch.batch(5, 5, timeout_s=20)
        state = orch.snapshot()
        await orch.stop()
        return batch, state

    batch, state = asyncio.run(scenario())
    assert batch.step == 5 and batch.lineage == 1 and state.consumed == 12 and state.counts["restarts"] == 1
    assert not {request_of(s.id) for s in batch.samples} & {"p4", "p5", "p6", "p9"}


def test_the_state_caught_up_is_persisted_before_the_answer(tmp_path, fakes):
    from moe_rl_eks.workloads.orchestrator.state_file import read_state

    servers, path = fakes(1), tmp_path / "orchestrator-state.json"

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, state=checkpointed_state(), state_path=path,
                            orchestrator={"max_staleness": 2})
        await orch.start()
        with pytest.raises(StepConflict, match="no trainer version is held"):
            await orch.catch_up({2: ["p5", "p6"]})
        await orch.publish(VersionRef(0, 4))
        next_step = await orch.catch_up({2: ["p5", "p6"], 3: ["p4", "p9"]})
        await orch.stop()
        return next_step

    assert asyncio.run(scenario()) == 4
    saved = read_state(path)
    # p9 is skipped when drawn, or, drawn after the version post and before the record, taken out of flight
    assert saved.consumed == 8 and saved.first_step == 0 and saved.trained_ahead == ([9] if saved.next_prompt <= 9 else [])
    assert not {4, 5, 6, 9} & {p.index for p in saved.pending} | {g.prompt_index for g in saved.buffered}


def test_an_orchestrator_restarted_after_a_catch_up_still_holds_the_state_before_it(tmp_path, fakes):
    """The state before a catch-up is in the state file (format 5): an orchestrator restarted from that file,
    whose trainer then dies and resumes from the checkpoint older than the catch-up, serves that checkpoint's next
    step again instead of refusing it."""
    from moe_rl_eks.workloads.orchestrator.state_file import read_state

    servers, path = fakes(1), tmp_path / "orchestrator-state.json"

    async def caught_up():
        orch = orchestrator(tmp_path, servers.urls, state=checkpointed_state(), state_path=path,
                            orchestrator={"max_staleness": 2})
        await orch.start()
        await orch.publish(VersionRef(0, 4))
        await orch.catch_up({2: ["p5", "p6"], 3: ["p4", "p9"]})
        checkpoint = orch.snapshot()  # what /v1/state (a trainer checkpoint) records
        await orch.stop()
        return checkpoint

    async def restarted(saved):
        orch = orchestrator(tmp_path, servers.urls, state=saved, state_path=path, orchestrator={"max_staleness": 2})
        await orch.start()
        await orch.publish(VersionRef(0, 4))  # the trainer re-posts its version to the restarted orchestrator
        await orch.publish(VersionRef(1, 2))  # then dies and resumes from its checkpoint of step 2
        batch = await orch.batch(2, 2, timeout_s=20)
        await orch.stop()
        return batch

    checkpoint = asyncio.run(caught_up())
    saved = read_state(path)
    assert checkpoint.held is None and saved.held is not None
    assert (saved.held.next_step, saved.held.lineage, saved.held.until) == (2, 0, 4)
    assert saved.held.state.consumed == 4 and saved.consumed == 8
    batch = asyncio.run(restarted(saved))
    assert batch.step == 2 and batch.lineage == 1
    assert not {request_of(s.id) for s in batch.samples} & {"p0", "p1", "p2", "p3"}


def test_a_newest_checkpoint_that_does_not_fit_the_record_is_refused_and_one_at_the_trainers_step_is_adopted(
        tmp_path, fakes):
    """The state (next step 2) is older than the record of step 3. A newest checkpoint state as old (step 2) fits no
    better: refused naming both, nothing changed. One of step 4 (batches 0..3 formed) already holds the record's
    step: adopted with no step to catch up, persisted, and counted."""
    from moe_rl_eks.workloads.orchestrator.state_file import read_state

    servers, path = fakes(1), tmp_path / "orchestrator-state.json"
    ahead = GroupBuffer(prompts_per_step=2, max_staleness=2, correct_reward=1.0)
    ahead.set_trainer(VersionRef(0, 0))
    for i in range(8):
        complete(ahead, i, 0)
        if i % 2:
            ahead.batch(i // 2, 0, 0, GRPO)
    at_step_4 = dataclasses.replace(ahead.snapshot(), source={"kind": BUILTIN_SOURCE, "cursor": 8})

    def formed(state):  # what a catch-up changes (prompts may be issued meanwhile: the budget is open)
        return state.consumed, state.first_step, sorted(state.batches), state.trained_ahead

    def newest_checkpoint(orch, state):
        newest = final_dir(orch.checkpoints, 4)
        newest.mkdir(parents=True, exist_ok=True)
        (newest / ORCHESTRATOR_STATE).write_text(json.dumps(state.to_json()))
        (orch.checkpoints / LATEST).write_text(newest.name)

    async def scenario():
        orch = orchestrator(tmp_path, servers.urls, state=checkpointed_state(), state_path=path,
                            orchestrator={"max_staleness": 2})
        await orch.start()
        await orch.publish(VersionRef(0, 4))
        newest_checkpoint(orch, checkpointed_state())
        before = formed(orch.snapshot())
        with pytest.raises(StepConflict, match=r"steps 2\.\.2 are known to neither; nor does the trainer's record fit "
                                               r"the run's newest checkpoint state .*step-00000004.*steps 2\.\.2"):
            await orch.catch_up({3: ["p6", "p7"]})
        refused = formed(orch.snapshot()) == before == (4, 0, [0, 1], [])
        newest_checkpoint(orch, at_step_4)
        next_step = await orch.catch_up({3: ["p6", "p7"]})
        metrics = orch.metrics.exposition().decode()
        await orch.stop()
        return refused, next_step, metrics

    refused, next_step, metrics = asyncio.run(scenario())
    assert refused and next_step == 4 and read_state(path).consumed == 8
    assert 'moerl_orchestrator_catch_ups_total{state="newest_checkpoint"} 1.0' in metrics
    assert "moerl_orchestrator_caught_up_steps_total 0.0" in metrics


@pytest.mark.parametrize("committed, on_disk, caught_up, state", [
    (lambda step: 0, None, 6, "own"), (lambda step: min(step // 2 * 2, 4), 4, 2, "newest_checkpoint")],
    ids=["never-checkpointed", "past-its-checkpoint"])
def test_an_orchestrator_started_with_no_state_refuses_a_trainer_past_step_0_and_catches_up_from_its_record(
        tmp_path, fakes, committed, on_disk, caught_up, state):
    """Its state file lost and no --resume, the orchestrator would serve the trainer's step 6 from the start of the
    prompt stream: it refuses step 6 instead (changing nothing) and catches up from the trainer's record, as the
    state at step 0 (a fresh stream) for a trainer that never checkpointed (record 0..5), or from the newest
    checkpoint's state (step 4, on disk) for one past it (record 2..5); it counts the start as a restart and serves
    6 and 7 with no prompt the trainer trained (`committed`: the trainer's newest checkpoint at each step)."""
    source, trained, (orch, second) = first_life_then_a_lost_state_file(
        tmp_path, fakes(1), checkpoint_at=None, committed=committed, on_disk=on_disk)
    try:
        later = {}
        for step in (6, 7):
            later[step] = source.next_batch(step, committed(step), lambda: False)
            source.version_published(step + 1, 0)
        counts = dict(orch.buffer.counts)
        metrics = catch_up_metrics(second.url)
    finally:
        second.stop()
    assert counts["caught_up_steps"] == caught_up and counts["restarts"] == 1 and source.reannounced >= 1
    assert metrics == {f'moerl_orchestrator_catch_ups_total{{state="{state}"}}': 1.0,
                       "moerl_orchestrator_caught_up_steps_total": float(caught_up)}
    prompts_trained = {request_of(i) for ids in trained.values() for i in ids}
    seen = [request_of(x.id) for s in (6, 7) for x in later[s].samples]
    assert [later[s].step for s in (6, 7)] == [6, 7] and len(set(seen)) == 4 and not set(seen) & prompts_trained


def test_an_orchestrator_started_with_no_state_serves_a_trainer_resumed_from_its_checkpoint_from_its_state(
        tmp_path, fakes, caplog):
    """Trainer and orchestrator both restarted, the orchestrator with no state: the trainer, resumed from its
    checkpoint of step 4 in lineage 1, gets step 4 formed from that checkpoint's orchestrator state (as --resume
    of it would), not from the start of the prompt stream."""
    from moe_rl_eks.workloads.trainer.orchestrator_link import HttpBatchSource

    _, trained, (orch, second) = first_life_then_a_lost_state_file(
        tmp_path, fakes(1), checkpoint_at=None, committed=lambda step: step // 2 * 2, on_disk=4)
    try:
        resumed = HttpBatchSource(second.url)
        resumed.version_published(4, 1)
        with caplog.at_level("WARNING", logger="moe_rl_eks.workloads.orchestrator.driver"):
            batch = resumed.next_batch(4, 4, lambda: False)
        restarts = orch.buffer.counts["restarts"]
    finally:
        second.stop()
    assert batch.step == 4 and batch.lineage == 1 and restarts == 1
    assert any("started with no state: serving the trainer from its checkpoint's orchestrator state" in r.message
               and "step-00000004" in r.message for r in caplog.records)
    assert not {request_of(x.id) for x in batch.samples} & {request_of(i) for s in range(4) for i in trained[s]}


def test_an_orchestrator_started_with_no_state_refuses_a_trainer_whose_checkpoint_holds_none(tmp_path, fakes):
    """The trainer resumed from a checkpoint of step 4 that this run's output does not hold (no orchestrator state
    to take): refused, naming the fix, and the trainer fails naming both refusals rather than train prompts
    again."""
    source, _, (orch, second) = first_life_then_a_lost_state_file(tmp_path, fakes(1), checkpoint_at=None,
                                                                  committed=lambda step: step // 2 * 2)
    try:
        with pytest.raises(RuntimeError, match=r"409 .*started with no state, and the trainer.{1,2}s checkpoint at "
                                               r"step 4 has no orchestrator state at .*step-00000004/orchestrator\.json"
                                               r": restart it with --resume.*our record of steps 2\.\.5 was refused"):
            source.next_batch(6, 4, lambda: False)
        assert orch.buffer.first_step is None and orch.buffer.counts["caught_up_steps"] == 0
    finally:
        second.stop()
