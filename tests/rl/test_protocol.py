"""The wire records: JSON round trips, malformed input rejected naming the field, routing references, seeds,
versions and the staleness rule."""
import json

import pytest
from pydantic import ValidationError

from moe_rl_eks.workloads.rl.openai_api import CompletionRequest, read_completion
from moe_rl_eks.workloads.rl.protocol import (Batch, BatchStats, Group,
                                              OrchestratorState, PromptRecord, ProtocolError, RoutingRef, Sample,
                                              TrainingSample, VersionRef, VersionSpan, derive_seed, one_version,
                                              staleness_ok)

REF = RoutingRef("cmpl-1-0", "uint8", (3, 2, 2), 12, "0123456789abcdef")


def sample(i, lineage=1, version=3):
    return TrainingSample(id=f"p{i}/0", prompt_ids=[1, 2], completion_ids=[5, 2], logprobs=[-0.5, -0.1],
                          reward=1.0, advantage=0.5, finished=True,
                          versions=[VersionSpan(lineage, version - 1, 1), VersionSpan(lineage, version, 1)])


def batch():
    stats = BatchStats(reward_mean=0.5, accuracy=0.25, staleness_mean=1.0, dropped_stale_groups=0,
                       filtered_groups=0, retries=1, rewards_failed=0, completed=2)
    return Batch(step=4, lineage=1, samples=[sample(0), sample(1)], stats=stats)


def test_records_round_trip_through_json():
    b = batch()
    assert Batch.from_json(json.loads(json.dumps(b.to_json()))) == b
    group = Group("p7", 7, [1, 2], VersionRef(0, 2), [Sample([5, 2], [-0.1, -0.2], 1.1, True, one_version(VersionRef(0, 2), 2), REF)])
    pending = PromptRecord(8, [1, 2], "1+1=", "2", "arithmetic", {"level": [1]})
    state = OrchestratorState(next_prompt=9, consumed=2, pending=[pending], buffered=[group], batches={4: b},
                              counts={"retries": 1}, trainer=VersionRef(1, 4), forks={1: VersionRef(0, 2)},
                              source={"cursor": 9})
    back = OrchestratorState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state and back.batches[4].samples[1].versions == [VersionSpan(1, 2, 1), VersionSpan(1, 3, 1)]


@pytest.mark.parametrize("mutate, path, expected", [
    (lambda d: d["samples"][1].update(advantage="x"), "batch.samples[1].advantage", "a finite number"),
    (lambda d: d["samples"][0].update(logprobs=[-0.5]), "batch.samples[0].logprobs", "one per completion token"),
    (lambda d: d["samples"][0]["versions"][1].update(lineage=-1), "batch.samples[0].versions[1].lineage", ">= 0"),
    (lambda d: d["samples"][0]["versions"][1].update(tokens=2), "batch.samples[0].versions",
     "add up to the completion's 2 tokens"),
    (lambda d: d["samples"][0]["versions"].reverse(), "batch.samples[0].versions", "each of newer weights"),
    (lambda d: d["samples"][0]["versions"][0].update(tokens=0), "batch.samples[0].versions[0].tokens", ">= 1"),
    (lambda d: d["samples"][0].pop("reward"), "batch.samples[0].reward", "required field missing"),
    (lambda d: d["stats"].update(colour=1), "batch.stats.colour", "unknown field"),
    (lambda d: d.update(step=True), "batch.step", "an integer"),
    (lambda d: d["samples"][0].update(finished=1), "batch.samples[0].finished", "true or false"),
    (lambda d: d.update(samples=[]), "batch.samples", "at least one sample"),
])
def test_malformed_records_are_rejected_naming_the_field(mutate, path, expected):
    data = batch().to_json()
    mutate(data)
    with pytest.raises(ProtocolError, match=expected) as err:
        Batch.from_json(data)
    assert str(err.value).startswith(f"{path}: ") and err.value.path == path


def test_a_completion_response_is_read_into_typed_choices():
    logprobs = lambda values: {"tokens": [], "token_logprobs": values, "top_logprobs": None, "text_offset": []}  # noqa: E731
    body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "policy", "weight_version": 5,
            "weight_lineage": 2,
            "choices": [{"index": 1, "text": "3", "token_ids": [9, 2], "finish_reason": "length",
                         "logprobs": logprobs([-0.25, -0.5]), "routed_experts": None,
                         "weight_versions": [{"version": 5, "lineage": 2, "tokens": 1},
                                             {"version": 6, "lineage": 2, "tokens": 1}]},
                        {"index": 0, "text": "4", "token_ids": [10], "finish_reason": "stop",
                         "logprobs": logprobs([-1.0]), "weight_versions": [{"version": 5, "lineage": 2, "tokens": 1}]}]}
    c = read_completion(body)
    assert c.version == VersionRef(2, 5) and [ch.index for ch in c.choices] == [0, 1] and c.lineage_reported
    assert c.choices[1].versions == [VersionSpan(2, 5, 1), VersionSpan(2, 6, 1)]  # swapped in flight after a token
    older = json.loads(json.dumps(body))  # a server from before per-token versions
    del older["choices"][0]["weight_versions"]
    with pytest.raises(ProtocolError, match=r"^response.choices\[0\].weight_versions: None .*servers of wire format 2 "
                                            r"on return: upgrade the rollout server"):
        read_completion(older)
    assert c.choices[1].logprobs == [-0.25, -0.5] and c.choices[0].finish_reason == "stop"
    assert not read_completion({**body, "weight_lineage": None}).lineage_reported
    body["choices"][0]["logprobs"]["token_logprobs"] = [-0.25]
    with pytest.raises(ProtocolError, match=r"^response.choices\[0\].logprobs: .*one per completion token"):
        read_completion(body)
    with pytest.raises(ProtocolError, match=r"^response.weight_version: None .*integer"):
        read_completion({**body, "weight_version": None})
    with pytest.raises(ProtocolError, match=r"^response.choices: \[0, 0\]"):
        read_completion({**body, "choices": [body["choices"][1], body["choices"][1]]})


def test_the_orchestrators_request_is_the_servers_schema_and_checks_its_seed():
    r = CompletionRequest(prompt=[1, 2], n=4, max_tokens=3, temperature=1.0, top_p=0.9, seed=derive_seed(0, 1),
                          logprobs=0, logprob_mode="processed")
    data = r.to_json()
    assert data["logprob_mode"] == "processed" and data["logprobs"] == 0 and "stop_token_ids" not in data
    assert CompletionRequest.model_validate(data) == r  # what is sent is what the server reads
    with pytest.raises(ValidationError, match="seed"):
        CompletionRequest.model_validate({**data, "seed": 2**64})


@pytest.mark.parametrize("change, path, expected", [
    ({"key": "../etc/passwd"}, "routing_ref.key", "no path"),
    ({"key": "a/b"}, "routing_ref.key", "no path"),
    ({"shape": [3, 2]}, "routing_ref.shape", "positions >= 0, layers >= 1, k >= 1"),
    ({"shape": [3, 0, 2]}, "routing_ref.shape", "layers >= 1"),
    ({"bytes": 13}, "routing_ref.bytes", "12 for uint8"),
    ({"dtype": "int16"}, "routing_ref.bytes", "24 for int16"),
    ({"dtype": "int64"}, "routing_ref.dtype", "allowed: 'uint8', 'int16'"),
    ({"checksum": "XYZ"}, "routing_ref.checksum", "16 lowercase hex digits"),
    ({"compression": "gzip"}, "routing_ref.compression", "allowed: 'none', 'zlib'"),
])
def test_a_malformed_routing_reference_is_refused_naming_the_field(change, path, expected):
    assert RoutingRef.from_json(REF.to_json()) == REF
    with pytest.raises(ProtocolError, match=rf"^{path}: .*{expected}"):
        RoutingRef.from_json({**REF.to_json(), **change})


def test_a_training_samples_routing_must_cover_prompt_plus_completion_minus_one_positions():
    good = TrainingSample("p0/0", [1, 2], [5, 2], [-0.5, -0.1], 1.0, 0.5, True, one_version(VersionRef(0, 0), 2),
                          REF).to_json()
    assert TrainingSample.from_json(good).routing == REF
    with pytest.raises(ProtocolError, match=r"^training_sample\.routing: .*prompt \+ completion - 1 = 2 positions "
                                            r"\(it covers 3\)"):
        TrainingSample.from_json({**good, "completion_ids": [5], "logprobs": [-0.5], "versions": [{"lineage": 0, "version": 0, "tokens": 1}]})


def test_derived_seeds_are_stable_in_range_and_do_not_collide_across_nearby_runs():
    assert derive_seed(0, 5) == derive_seed(0, 5) and derive_seed(0, 5) != derive_seed(0, 6)
    # seed * 100_000 + i collided whenever two runs' seeds differed by one and their prompts by 100_000
    seeds = {derive_seed(run, i) for run in range(20) for i in range(0, 500_000, 997)}
    assert len(seeds) == 20 * len(range(0, 500_000, 997))
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(2**64 - 1, 2**64 - 1) < 2**63
    with pytest.raises(ProtocolError, match=r"^counters\[0\]: -1"):
        derive_seed(0, -1)


def test_the_staleness_rule_refuses_newer_weights_and_other_lineages():
    trainer = VersionRef(lineage=1, version=10)
    assert staleness_ok(trainer, VersionRef(1, 10), 0) and staleness_ok(trainer, VersionRef(1, 8), 2)
    assert not staleness_ok(trainer, VersionRef(1, 7), 2)  # too old
    assert not staleness_ok(trainer, VersionRef(1, 15), 2)  # from the future: a restart's stale servers
    assert not staleness_ok(trainer, VersionRef(0, 10), 2)  # the dead lineage, same number
    # lineage 1 resumed from lineage 0's checkpoint of step 8: versions <= 8 of lineage 0 are its history
    forks = {1: VersionRef(0, 8)}
    assert staleness_ok(trainer, VersionRef(0, 8), 2, forks) and not staleness_ok(trainer, VersionRef(0, 9), 2, forks)
    # and lineage 2 resumed from lineage 1's step 9: lineage 0 up to 8 still counts, through both forks
    forks[2] = VersionRef(1, 9)
    assert staleness_ok(VersionRef(2, 10), VersionRef(0, 8), 2, forks)
    assert staleness_ok(VersionRef(2, 10), VersionRef(1, 9), 2, forks)
    assert not staleness_ok(VersionRef(2, 10), VersionRef(1, 10), 2, forks)
    assert VersionRef(0, 99) < VersionRef(1, 0) < VersionRef(1, 1)


def test_a_mixed_version_samples_staleness_is_its_oldest_tokens_and_every_span_keeps_the_lineage_rule():
    from moe_rl_eks.workloads.rl.protocol import first_tokens, sample_staleness, tokens_trainable

    spans = [VersionSpan(0, 3, 5), VersionSpan(0, 4, 2)]  # 5 tokens of version 3, then 2 of version 4 (a swap)
    assert sample_staleness(5, spans) == 2 and sample_staleness(5, []) == 0
    assert tokens_trainable(VersionRef(0, 5), spans, 2)
    assert not tokens_trainable(VersionRef(0, 5), spans, 1)  # the oldest token, not the newest, bounds it
    assert not tokens_trainable(VersionRef(0, 3), spans, 2)  # a token newer than the trainer's step
    # Across a trainer restart: lineage 1 began at lineage 0's step 3, so version 3 of lineage 0 is its history
    # but a token of lineage 0's version 4 (a dead trainer's) is not, whichever span holds it.
    forks = {1: VersionRef(0, 3)}
    assert tokens_trainable(VersionRef(1, 4), [VersionSpan(0, 3, 5), VersionSpan(1, 4, 2)], 2, forks)
    assert not tokens_trainable(VersionRef(1, 4), spans, 2, forks)
    assert first_tokens(spans, 6) == [VersionSpan(0, 3, 5), VersionSpan(0, 4, 1)]  # cut at a stop string
    assert first_tokens(spans, 5) == [VersionSpan(0, 3, 5)] and first_tokens(spans, 0) == []


def test_persisted_state_and_batches_carry_their_format_and_an_older_or_newer_one_is_refused_not_misread():
    from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer
    from moe_rl_eks.workloads.rl.protocol import STATE_FORMAT, WIRE_FORMAT

    # wire format 3: routing by reference to the routing store; state format 5: the state held from before a
    # catch-up (format 4: the prompts trained ahead)
    assert (WIRE_FORMAT, STATE_FORMAT) == (3, 5)
    state = GroupBuffer(prompts_per_step=1, max_staleness=0, correct_reward=1.0).snapshot().to_json()
    assert state["format"] == STATE_FORMAT and OrchestratorState.from_json(state).format == 5
    assert OrchestratorState.from_json({**state, "format": 4}).held is None  # a format-4 state held none
    held = {"state": state, "next_step": 0, "lineage": 0, "until": 1}
    assert OrchestratorState.from_json({**state, "held": held}).held.until == 1
    with pytest.raises(ProtocolError, match=r"^orchestrator_state\.held: .*holds none itself"):
        OrchestratorState.from_json({**state, "held": {**held, "state": {**state, "held": held}}})
    old = {k: v for k, v in state.items() if k != "format"}  # written before formats were recorded: format 1
    with pytest.raises(ProtocolError, match=r"^orchestrator_state\.format: 1 .*format 1 by an older moe-rl-eks; this "
                                            r"one reads format 5 \(format 2 records each sample's per-token "
                                            r"weight versions; format 3 refers to each sample's routed experts.*; "
                                            r"format 4 lists the prompts a trainer trained.*; format 5 keeps"):
        OrchestratorState.from_json(old)
    with pytest.raises(ProtocolError, match=r"orchestrator_state\.format: .*format 9 by a newer moe-rl-eks; this one "
                                            r"reads formats up to 5"):
        OrchestratorState.from_json({**state, "format": 9})
    sample = TrainingSample("p0/0", [1, 2], [3], [-0.5], 1.0, 1.0, True, one_version(VersionRef(0, 0), 1))
    batch = Batch(0, 0, [sample], BatchStats(0.0, 1.0, 0.0, 0, 0, 0, 0, 1), format=WIRE_FORMAT).to_json()
    assert Batch.from_json(batch).samples[0].versions == [VersionSpan(0, 0, 1)]
    with pytest.raises(ProtocolError, match=r"^batch\.format: 4 .*newer moe-rl-eks"):
        Batch.from_json({**batch, "format": 4})
    # A format-1 batch (each sample one `version`, no `versions`) is refused as older, not as a field missing.
    format_1 = {**batch, "format": 1, "samples": [{**{k: v for k, v in batch["samples"][0].items() if k != "versions"},
                                                   "version": {"lineage": 0, "version": 0}}]}
    with pytest.raises(ProtocolError, match=r"^batch\.format: 1 .*older moe-rl-eks; this one reads format 3"):
        Batch.from_json(format_1)


def test_a_format_2_record_without_routing_is_migrated_and_one_with_inline_routing_arrays_is_refused():
    sample = TrainingSample("p0/0", [1, 2], [3], [-0.5], 1.0, 1.0, True, one_version(VersionRef(0, 0), 1))
    batch = {**Batch(0, 0, [sample], BatchStats(0.0, 1.0, 0.0, 0, 0, 0, 0, 1)).to_json(), "format": 2}
    assert Batch.from_json(batch).format == 3  # same layout without routing: read as format 3
    group = Group("p7", 7, [1, 2], VersionRef(0, 2), [Sample([5, 2], [-0.1, -0.2], 1.1, True,
                                                             one_version(VersionRef(0, 2), 2))]).to_json()
    group["samples"][0]["routing"] = "k05VTVBZAQB2AHsn"  # base64 .npy, as format 2 carried it
    state = {**OrchestratorState(0, 0, [], [], {}, {}).to_json(), "format": 2, "buffered": [group]}
    with pytest.raises(ProtocolError, match=r"^orchestrator_state\.format: 2 .*carries routing arrays inline, which "
                                            r"format 3 keeps in the routing store"):
        OrchestratorState.from_json(state)
    del group["samples"][0]["routing"]  # without routing: format 2's state layout is format 5's less trained_ahead
    migrated = OrchestratorState.from_json({**state, "buffered": [group]})
    assert migrated.format == 5 and migrated.trained_ahead == [] and migrated.buffered[0].request_id == "p7"


def test_a_format_3_state_is_read_with_no_prompt_trained_ahead_and_a_format_4_one_keeps_them():
    from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer

    state = OrchestratorState(5, 4, [], [], {}, {"completed": 4}, first_step=0, trained_ahead=[9, 12]).to_json()
    state["format"] = 4
    assert state["trained_ahead"] == [9, 12]
    restored = GroupBuffer.restore(OrchestratorState.from_json(state), prompts_per_step=2, max_staleness=0,
                                   correct_reward=1.0)
    assert restored.trained_ahead == {9, 12} and restored.snapshot().trained_ahead == [9, 12]
    format_3 = {k: v for k, v in state.items() if k != "trained_ahead"} | {"format": 3}
    assert OrchestratorState.from_json(format_3).trained_ahead == []
    with pytest.raises(ProtocolError, match=r"^orchestrator_state\.format: 6 .*newer moe-rl-eks"):
        OrchestratorState.from_json({**state, "format": 6})
