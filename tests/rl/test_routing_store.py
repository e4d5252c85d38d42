"""The routing store and the references to it: the binary format round trip (uint8 / int16, raw or zlib), every
bad reference refused naming its field, orphans swept by age, and the buffer's rule for when a sample's routing may
go (trained and checkpointed, or never to train); the orchestrator's state holds references, never arrays."""
import json
import os
import re
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from moe_rl_eks.workloads.orchestrator.buffer import GroupBuffer
from moe_rl_eks.workloads.rl.protocol import (Group, OrchestratorState, PromptRecord, ProtocolError, Sample,
                                              VersionRef, one_version)
from moe_rl_eks.workloads.rl.routing_store import RoutingStore

GRPO = lambda rewards: [r - sum(rewards) / len(rewards) for r in rewards]


@pytest.mark.parametrize("experts, dtype", [(4, np.uint8), (256, np.uint8), (300, np.int16)])
@pytest.mark.parametrize("compression", ["none", "zlib"])
def test_routing_round_trips_in_the_narrowest_of_uint8_and_int16(tmp_path, experts, dtype, compression):
    store = RoutingStore(tmp_path, compression)
    ids = np.random.default_rng(0).integers(0, experts, size=(7, 3, 2))
    ids[0, 0, 0] = experts - 1
    ref = store.write("cmpl-x-0", ids, experts)
    assert (ref.dtype, ref.shape, ref.compression) == (np.dtype(dtype).name, (7, 3, 2), compression)
    stored = (tmp_path / ref.key).read_bytes()
    assert len(stored) == ref.bytes
    if compression == "none":  # the object is the C-order ids and nothing else: bytes = positions x layers x k x width
        assert ref.bytes == 7 * 3 * 2 * np.dtype(dtype).itemsize
        assert np.array_equal(np.frombuffer(stored, dtype).reshape(7, 3, 2), ids)
    back = store.read(ref)
    assert back.dtype == dtype and np.array_equal(back, ids)
    assert not list(tmp_path.glob(".*.tmp"))  # the writer's temporary file was renamed into place


def test_ids_outside_the_models_experts_or_not_three_dimensional_are_refused_at_write(tmp_path):
    store = RoutingStore(tmp_path)
    with pytest.raises(ProtocolError, match=r"^routing: 'ids in \[0, 4\]' .*expert ids in \[0, 4\)"):
        store.write("k", np.array([[[0, 4]]]), 4)
    with pytest.raises(ProtocolError, match="integer expert ids"):
        store.write("k", np.zeros((3, 2)), 4)
    with pytest.raises(ProtocolError, match=r"^key: '\.\./k'"):
        store.write("../k", np.zeros((1, 1, 1), np.int64), 4)


MODEL = SimpleNamespace(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2)  # what read checks of a model


@pytest.mark.parametrize("compression", ["none", "zlib"])
def test_a_reference_that_does_not_match_its_object_or_the_model_is_refused_naming_the_field(tmp_path, compression):
    store = RoutingStore(tmp_path, compression)
    ids = np.random.default_rng(1).integers(0, 4, size=(5, 3, 2))
    ref = store.write("r", ids, 4)
    cases = [
        (replace(ref, key="gone"), "samples[2].routing.key", "there is none"),
        (replace(ref, bytes=ref.bytes + 1), "samples[2].routing.bytes", f"the object's size, {ref.bytes} bytes"),
        (replace(ref, checksum="0" * 16), "samples[2].routing.checksum", "the object's XXH3-64"),
        (replace(ref, shape=(5, 2, 2)), "samples[2].routing.shape", "3 layers, 2 experts per token"),
        (replace(ref, dtype="int16"), "samples[2].routing.dtype", "uint8, the id type of 4 experts"),
    ]
    for bad, path, expected in cases:
        with pytest.raises(ProtocolError, match=rf"^{re.escape(path)}: .*{expected}"):
            store.read(bad, "samples[2].routing", MODEL)
    if compression == "zlib":  # the size and checksum are the compressed object's: the shape is checked unpacked
        with pytest.raises(ProtocolError, match=r"^routing\.shape: \[4, 3, 2\] .*30 ids of uint8 as stored"):
            store.read(replace(ref, shape=(4, 3, 2)))
    (tmp_path / "r").write_bytes(b"\0" * ref.bytes)  # same size, other bytes
    with pytest.raises(ProtocolError, match=r"^routing\.checksum: "):
        store.read(ref)


def test_a_sweep_removes_objects_no_state_refers_to_once_they_are_old_and_keeps_the_rest(tmp_path):
    store = RoutingStore(tmp_path)
    refs = {k: store.write(k, np.zeros((10, 1, 1), np.int64), 4) for k in ("live", "orphan", "young")}
    (tmp_path / ".torn.abc.tmp").write_bytes(b"x" * 3)  # a writer that died before its rename
    old = time.time() - 1000
    for name in ("live", "orphan", ".torn.abc.tmp"):
        os.utime(tmp_path / name, (old, old))
    assert store.sweep({"live"}, older_than_s=900) == 10 + 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "young"]
    assert store.delete([refs["live"], refs["orphan"]]) == 10  # already gone: skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["young"]


def routed_group(store, i, rewards=(1.0, 0.0), version=0):
    samples = [Sample([5, 2], [-1.0, -0.5], r, True, one_version(VersionRef(0, version), 2),
                      store.write(f"g{i}-{j}", np.full((3, 2, 2), j, np.int64), 4)) for j, r in enumerate(rewards)]
    return Group(f"p{i}", i, [1, 4], VersionRef(0, version), samples)


def complete(buf, store, i, **kw):
    buf.issue(PromptRecord(i, [1, 4], "1+1=", "2"))
    rewards = kw.pop("rewards", (1.0, 0.0))
    return buf.complete(routed_group(store, i, rewards, kw.pop("version", 0)), rewards_failed=0, **kw).kind


def test_a_batchs_routing_is_released_only_once_a_checkpoint_past_its_step_is_committed(tmp_path):
    store = RoutingStore(tmp_path)
    buf = GroupBuffer(prompts_per_step=1, max_staleness=1, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 0))
    for i in range(3):
        complete(buf, store, i, dynamic_sampling=False)
    batch0 = buf.batch(0, 0, 0, GRPO)
    buf.set_trainer(VersionRef(0, 1))
    assert buf.batch(1, 0, 1, GRPO) is not None  # checkpoint of step 1 committed: step 0 trained and checkpointed
    assert sorted(r.key for r in buf.take_released()) == sorted(s.routing.key for s in batch0.samples)
    assert buf.batch(1, 0, 1, GRPO) is not None and buf.take_released() == []  # step 1 is not checkpointed yet
    # what the state still refers to: batch 1 and the waiting group, each by reference only
    assert sorted(buf.live_routing()) == ["g1-0", "g1-1", "g2-0", "g2-1"]


def test_routing_of_groups_that_will_never_train_is_released_when_that_is_known(tmp_path):
    store = RoutingStore(tmp_path)
    buf = GroupBuffer(prompts_per_step=1, max_staleness=0, correct_reward=1.0)
    buf.set_trainer(VersionRef(0, 1))
    assert complete(buf, store, 0, rewards=(1.0, 1.0), dynamic_sampling=True) == "filtered"
    assert complete(buf, store, 1, rewards=(1.0,), dynamic_sampling=False) == "too_few"
    assert complete(buf, store, 2, version=0, dynamic_sampling=False) == "kept"  # stale at step 1
    late = buf.complete(routed_group(store, 9, (1.0, 0.0)), rewards_failed=0, dynamic_sampling=False)
    assert late.kind == "duplicate"  # never issued (or answered already): its own objects go
    buf.drop_stale(1, 0)
    assert sorted(r.key for r in buf.take_released()) == ["g0-0", "g0-1", "g1-0", "g2-0", "g2-1", "g9-0", "g9-1"]
    assert buf.live_routing() == {}


def test_the_orchestrators_state_holds_references_of_fixed_size_whatever_the_routing_size(tmp_path):
    sizes = []
    for layers, k in ((2, 2), (4800, 80)):  # 100,000 x more routing (12 bytes a sample, then 1.15 MB): same state
        store = RoutingStore(tmp_path / str(layers))
        buf = GroupBuffer(prompts_per_step=1, max_staleness=0, correct_reward=1.0)
        buf.set_trainer(VersionRef(0, 0))
        buf.issue(PromptRecord(0, [1, 4], "1+1=", "2"))
        samples = [Sample([5, 2], [-1.0, -0.5], r, True, one_version(VersionRef(0, 0), 2),
                          store.write(f"s{j}", np.ones((3, layers, k), np.int64), 128))
                   for j, r in enumerate((1.0, 0.0))]
        buf.complete(Group("p0", 0, [1, 4], VersionRef(0, 0), samples), rewards_failed=0, dynamic_sampling=False)
        buf.batch(0, 0, 0, GRPO)
        text = json.dumps(buf.snapshot().to_json())
        state = OrchestratorState.from_json(json.loads(text))
        assert state.batches[0].samples[1].routing == samples[1].routing  # the reference, checksum and all
        sizes.append(len(text))
    assert sizes[1] - sizes[0] <= 4 * 12 and sizes[1] < 3000  # a few more digits in each shape and size


def test_an_orchestrator_taking_a_checkpoints_state_deletes_the_routing_only_its_newer_state_held(tmp_path):
    import asyncio

    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.orchestrator.app import build

    run = tiny_run(tmp_path, training={"prompts_per_step": 1}, algorithm={"group_size": 2, "routing_replay": True})
    store = RoutingStore.of(run)
    cursor = build(run, ["http://127.0.0.1:9"], token=None).source.state()  # a fresh prompt source's

    def state_with(*indices):
        buf = GroupBuffer(prompts_per_step=1, max_staleness=1, correct_reward=1.0)
        buf.set_trainer(VersionRef(0, 0))
        for i in indices:
            complete(buf, store, i, dynamic_sampling=False)
        return replace(buf.snapshot(), source=cursor)

    checkpoint, own = state_with(0), state_with(0, 1)  # its own state also holds group 1, formed after the checkpoint

    async def scenario():
        orch = build(run, ["http://127.0.0.1:9"], token=None, state=own, fallback=checkpoint)  # no server answers
        await orch.start()
        await orch.publish(VersionRef(1, 0))  # a trainer resumed in a new lineage: the checkpoint's state is taken
        await orch.collect_routing()
        await orch.stop()

    asyncio.run(scenario())
    assert sorted(p.name for p in store.root.iterdir()) == ["g0-0", "g0-1"]  # group 1's objects had no state left
