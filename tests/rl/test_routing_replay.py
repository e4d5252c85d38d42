"""Routing replay through the real roles on 127.0.0.1: a rollout server writes each choice's routed experts to the
routing store, the orchestrator batches references (its state holds no array), the trainer reads its samples'
routing from the store and its forward uses exactly the experts the server chose; a batch's objects are deleted once
a checkpoint past its step is committed, and not before."""
import asyncio
import json

import torch
from rl_helpers import publish_initial, serve_rollout, tiny_run

from moe_rl_eks.core import metrics as M
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.orchestrator.app import build
from moe_rl_eks.workloads.rl.protocol import VersionRef
from moe_rl_eks.workloads.rl.routing_store import RoutingStore
from moe_rl_eks.workloads.trainer.loop import Trainer
from moe_rl_eks.workloads.trainer.microbatch import Sequences


def test_a_routing_replay_run_trains_on_the_experts_the_server_chose_and_deletes_them_after_the_checkpoint(
        tmp_path, world_of_one):
    serving = serve_rollout(tmp_path)
    rollout = next(serving)
    run = tiny_run(tmp_path, sampling={"max_n": 4, "max_prompt_tokens": 16, "max_tokens": 4},
                   algorithm={"group_size": 4, "routing_replay": True}, training={"prompts_per_step": 2},
                   orchestrator={"max_staleness": 0})
    store = RoutingStore.of(run)
    trainer = Trainer(run, None, rank=0, world=1)

    async def orchestrate():
        orch = build(run, [rollout["url"]], token="s3cret")
        await orch.start()
        await orch.publish(VersionRef(0, 0))
        first = await orch.batch(0, 0, timeout_s=60)
        state = orch.snapshot().to_json()
        publish_initial(run, rollout["store"], version=1)  # the same weights again: the routing checks stay simple
        await orch.publish(VersionRef(0, 1))
        second = await orch.batch(1, 0, timeout_s=60)  # no checkpoint yet: batch 0 must stay
        kept = sorted(p.name for p in store.root.iterdir())
        # what the trainer would train at step 0: its samples' routing read from the store by reference
        stored = [torch.from_numpy(store.read(s.routing).astype("int64")) for s in first.samples]
        t = Sequences.of(first.samples, trainer._read_routing).to(trainer.device)
        third_poll = await orch.batch(1, 1, timeout_s=60)  # the checkpoint of step 1 is committed
        left = sorted(p.name for p in store.root.iterdir())
        metrics = orch.metrics
        await orch.stop()
        return first, state, second, kept, third_poll, left, metrics, stored, t

    try:
        first, state, second, kept, again, left, metrics, stored, t = asyncio.run(orchestrate())
    finally:
        next(serving, None)
    # the state and the batch name their routing by reference, never inline
    assert all(isinstance(s["routing"], dict) and set(s["routing"]) >= {"key", "dtype", "shape", "bytes", "checksum"}
               for s in state["batches"]["0"]["samples"])
    assert len(json.dumps(state)) < 50 * len(first.samples) * 20
    # what the server chose is what the model routes on the served weights (publish_initial's seed-0 model); on the
    # CPU only, where the engine's forward and the model's reduce in the same order (tests/rl/test_generation.py)
    torch.manual_seed(0)
    served = MoETransformer(run.model).eval()
    for s, ids in zip(first.samples, stored) if not torch.cuda.is_available() else ():
        fed = torch.tensor([s.prompt_ids + s.completion_ids[:-1]])
        with torch.no_grad():
            chosen = torch.stack(served(fed, return_routing=True).routing, 2)[0]  # [positions, layers, k]
        assert torch.equal(ids, chosen)
    # the trainer's forward replays exactly those experts, read from the store by reference
    with torch.no_grad():
        out = trainer.model(t.packed_inputs(), sequence_lengths=t.lengths, routing_replay=t.packed_routing(),
                            return_routing=True)
    want = [torch.cat([r[:, layer] for r in stored]).unsqueeze(0) for layer in range(run.model.num_hidden_layers)]
    assert all(torch.equal(got.cpu(), w) for got, w in zip(out.routing, want))
    assert all(torch.equal(got.cpu(), w) for got, w in zip(t.packed_routing(), want))
    # deletion: batch 0's objects stay until a checkpoint past step 0 is committed, then go; batch 1's stay
    keys0, keys1 = {s.routing.key for s in first.samples}, {s.routing.key for s in second.samples}
    assert keys0 | keys1 <= set(kept) and again == second
    assert not keys0 & set(left) and keys1 <= set(left)
    value = metrics.registry.get_sample_value
    assert value("moerl_routing_deleted_bytes_total") >= sum(s.routing.bytes for s in first.samples)
    assert value(M.ROUTING_BYTES_STORED.name) >= sum(s.routing.bytes for s in second.samples)
