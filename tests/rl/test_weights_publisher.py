"""Background publication: publish() returns after the snapshot, a newer version supersedes a waiting one,
`published` is what reached the store, expert-parallel ranks each write their experts (two gloo processes), and
the sigmoid router's correction bias stays float32 from the trainer to the served model."""
import dataclasses
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import cast_for_serving, load_hf
from moe_rl_eks.workloads.model.safetensors_io import read_header
from moe_rl_eks.workloads.rl.protocol import VersionRef
from moe_rl_eks.workloads.trainer.orchestrator_link import Announcer
from moe_rl_eks.workloads.trainer.publisher import Publisher
from moe_rl_eks.workloads.rl.weights import DirectoryStore

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                     num_experts_per_tok=2, max_position_embeddings=64, dtype="bfloat16", router="sigmoid")


def trainer_state(seed=0):
    """What a trainer holds: float32 master weights, the routing bias moved by small updates."""
    torch.manual_seed(seed)
    model = MoETransformer(CONFIG)
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(CONFIG.num_experts) * 1e-3 + 0.5)
    return model.state_dict()


class GatedStore(DirectoryStore):
    """A directory store whose commits wait for `gate` (a disk slower than the trainer)."""

    def __init__(self, root):
        super().__init__(root, keep_versions=5)
        self.gate, self.committing = threading.Event(), threading.Event()

    def _commit(self, staging, manifest):
        self.committing.set()
        self.gate.wait(timeout=120)
        super()._commit(staging, manifest)


def test_publish_returns_after_the_snapshot_and_the_store_gets_those_bytes(tmp_path):
    store = GatedStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=0)
    state = trainer_state()
    expected = {k: v.clone() for k, v in state.items()}
    publisher.publish(0, state)
    assert store.committing.wait(60) and publisher.published is None  # still being written
    for t in state.values():  # the next optimizer step changes the weights in place
        t.add_(1.0)
    store.gate.set()
    publisher.close()
    assert publisher.published == 0 and store.latest() == VersionRef(0, 0)
    _, loaded = load_hf(store.fetch(0, tmp_path))
    for name, tensor in expected.items():
        want = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


def test_a_newer_version_supersedes_one_still_waiting(tmp_path):
    store = GatedStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=2)
    publisher.publish(10, trainer_state(10))
    assert store.committing.wait(60)  # version 10 is being written; 11 and 12 wait in turn
    for v in (11, 12, 13):
        publisher.publish(v, trainer_state(v))
    assert publisher.superseded == [11, 12]
    store.gate.set()
    publisher.close()
    assert publisher.published == 13 and store.latest() == VersionRef(2, 13)
    assert sorted(r.version for r in store._versions()) == [10, 13]
    _, loaded = load_hf(store.fetch(13, tmp_path))
    assert torch.equal(loaded["model.norm.weight"], trainer_state(13)["model.norm.weight"].to(torch.bfloat16))


def test_wait_published_reports_each_version_in_the_store_while_newer_ones_keep_the_writer_busy(tmp_path):
    store = GatedStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=0)
    publisher.publish(0, trainer_state())
    assert store.committing.wait(60)
    publisher.publish(1, trainer_state())  # waits behind version 0: the writer is never idle until 1 is written
    assert publisher.wait_published(None, timeout=0.2) is None
    store.gate.set()
    assert publisher.wait_published(None, timeout=30) in (0, 1)
    publisher.close()
    assert publisher.wait_published(0, timeout=30) == 1


def test_publishing_into_s3_uploads_the_snapshot_from_memory(tmp_path, s3_endpoint):
    import uuid

    import boto3

    from moe_rl_eks.workloads.rl.weights import S3Store

    bucket = f"pub-{uuid.uuid4().hex[:8]}"  # moto's state lives as long as the test process
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    store = S3Store(bucket, "run", endpoint_url=s3_endpoint)
    publisher = Publisher(store, CONFIG, lineage=0, max_shard_bytes=20_000)
    publisher.publish(0, trainer_state())
    publisher.close()
    assert publisher.published == 0 and len(publisher.layouts) > 1
    _, loaded = load_hf(store.fetch(0, tmp_path / "cache"))
    for name, tensor in trainer_state().items():
        want = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
        assert torch.equal(loaded[name], want), name


def test_a_failed_write_is_not_published_and_the_next_version_is(tmp_path):
    calls = []

    def extra_files(directory):
        calls.append(directory)
        if len(calls) == 1:
            raise OSError("disk full")
        (directory / "generation_config.json").write_text('{"eos_token_id": [2]}')

    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=0, extra_files=extra_files)
    publisher.publish(0, trainer_state())
    publisher.flush()
    assert publisher.published is None and publisher.failures == 1 and store.latest() is None
    publisher.publish(1, trainer_state())
    publisher.close()
    assert publisher.published == 1
    assert (store.fetch(1, tmp_path) / "generation_config.json").read_text() == '{"eos_token_id": [2]}'


def test_the_router_correction_bias_is_float32_bit_equal_from_trainer_to_served_model(tmp_path):
    state = trainer_state()
    bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not torch.equal(bias.to(torch.bfloat16).float(), bias)  # bf16 would change it
    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=0)
    publisher.publish(0, state)
    publisher.close()
    config, loaded = load_hf(store.fetch(0, tmp_path))
    served = MoETransformer(config)
    served.load_state_dict(loaded)
    cast_for_serving(served, torch.bfloat16)
    got = served.model.layers[1].mlp.gate.e_score_correction_bias
    assert got.dtype == torch.float32 and torch.equal(got, bias)
    assert served.model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16


def publishing_rank(rank: int, port: int, root: str, out: dict) -> None:
    from moe_rl_eks.workloads.moe.parallel import ExpertParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ep = ExpertParallel(dist.group.WORLD, "alltoall")
        full = trainer_state()
        experts = ep.local_experts(CONFIG.num_experts)
        mine = {k: v[experts.start:experts.stop] if ".mlp.experts." in k else v for k, v in full.items()}
        publisher = Publisher(DirectoryStore(root), CONFIG, lineage=0, ep=ep)
        publisher.publish(0, mine)
        publisher.close()
        out[rank] = (publisher.published, sorted(l.name for l in publisher.layouts))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_ranks_each_write_their_own_experts_and_rank0_commits(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(publishing_rank, args=(port, str(tmp_path / "store"), out), nprocs=2,
                       start_method="forkserver")
    assert out[0][0] == 0 and all(name.startswith("model-rank000-") for name in out[0][1])
    assert all(name.startswith("model-rank001-") for name in out[1][1])
    store = DirectoryStore(tmp_path / "store")
    directory = store.fetch(VersionRef(0, 0), tmp_path)
    _, loaded = load_hf(directory)  # every rank's shard, through the index, checksums verified
    for name, tensor in trainer_state().items():
        want = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
        assert torch.equal(loaded[name], want), name
    _, second_half = load_hf(directory, experts=range(2, 4))  # a serving rank reads only its experts
    assert torch.equal(second_half["model.layers.0.mlp.experts.down_proj"],
                       trainer_state()["model.layers.0.mlp.experts.down_proj"][2:4].to(torch.bfloat16))


def serving_rank(rank: int, port: int, run_path: str, directory: str, out: dict) -> None:
    from moe_rl_eks.core.run import load_run
    from moe_rl_eks.workloads.moe.parallel import ExpertParallel
    from moe_rl_eks.workloads.rollout.replica import Replica, SwapRefused, follow

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        replica = Replica(load_run(run_path), ep=ExpertParallel(dist.group.WORLD, "alltoall"),
                          control=dist.new_group(backend="gloo"), device=torch.device("cpu"))
        if rank > 0:
            follow(replica)
            out[rank] = replica.version
            return
        try:
            replica.begin_read(1, directory).exception()
            replica.swap(1)
        except SwapRefused as exc:
            out["refused"] = str(exc)
        out[rank] = replica.version
        replica.stop()
    finally:
        dist.destroy_process_group()


def test_a_sharded_server_refuses_on_every_rank_a_version_whose_checksum_fails_on_one(tmp_path):
    from rl_helpers import write_run

    from moe_rl_eks.core.run import load_run

    run_path = write_run(tmp_path)
    run = load_run(run_path)
    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, run.model, lineage=0)
    publisher.publish(1, MoETransformer(run.model).state_dict())
    publisher.close()
    directory = store.fetch(1, tmp_path)
    last = run.model.num_experts - 1  # held by rank 1 only
    shard = next(directory.glob("*.safetensors"))
    head, pieces = read_header(shard)
    piece = next(p for p in pieces if p.name == f"model.layers.0.mlp.experts.{last}.down_proj.weight")
    with open(shard, "r+b") as f:
        f.seek(len(head) + piece.start)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(serving_rank, args=(port, str(run_path), str(directory), out), nprocs=2,
                       start_method="forkserver")
    assert out[0] is None and out[1] is None  # neither rank swapped
    assert "rank 1: " in out["refused"] and f"experts.{last}.down_proj.weight does not match" in out["refused"]
    assert "rank 0" not in out["refused"]


def test_a_serving_replica_holds_the_router_bias_in_float32_bit_equal_to_the_trainers(tmp_path):
    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.rollout.replica import Replica

    run = tiny_run(tmp_path)
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, router="sigmoid", dtype="bfloat16"))
    torch.manual_seed(0)
    state = MoETransformer(run.model).state_dict()
    bias_name = "model.layers.0.mlp.gate.e_score_correction_bias"
    state[bias_name].copy_(torch.randn(run.model.num_experts) * 1e-3 + 0.5)
    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, run.model, lineage=0)
    publisher.publish(1, state)
    publisher.close()
    replica = Replica(run, device=torch.device("cpu"))
    try:
        replica.begin_read(1, str(store.fetch(1, tmp_path))).result()
        replica.swap(1)
        served = replica.model.state_dict()
    finally:
        replica.stop()
    assert served[bias_name].dtype == torch.float32 and torch.equal(served[bias_name], state[bias_name])
    assert served["model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16


def test_bench_weights_counts_exactly_the_bytes_a_publisher_writes(tmp_path):
    import json

    from moe_rl_eks.tools.bench.weights import published_bytes

    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, CONFIG, lineage=0, max_shard_bytes=20_000)
    publisher.publish(0, trainer_state())
    publisher.close()
    files = json.loads((store.fetch(0, tmp_path) / "manifest.json").read_text())["files"]
    assert published_bytes(CONFIG) == sum(f["data_bytes"] for n, f in files.items() if n.endswith(".safetensors"))


class Heard:
    """A batch source that records the versions announced to it."""

    def __init__(self):
        self.posts = []

    def version_published(self, version, lineage):
        self.posts.append((version, lineage))


def announcing(tmp_path, *, background):
    """A publisher on a store whose commits wait at its gate, its announcer, and version 0 held at that gate."""
    store, heard = GatedStore(tmp_path / "store"), Heard()
    publisher = Publisher(store, CONFIG, lineage=0)
    announcer = Announcer(publisher, heard, 0, background=background)
    publisher.publish(0, trainer_state())
    assert store.committing.wait(60)
    return store, heard, publisher, announcer


def test_a_synchronous_run_announces_a_version_offered_over_device_memory_before_its_store_write(tmp_path):
    store, heard, publisher, announcer = announcing(tmp_path, background=False)
    announcer.published(0, offered=True)  # the colocated server can take it from the trainer's memory now
    assert heard.posts == [(0, 0)] and publisher.published is None
    publisher.publish(1, trainer_state(1))
    waiting = threading.Thread(target=announcer.published, args=(1,))  # not offered: only once the store has it
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and heard.posts == [(0, 0)]
    store.gate.set()
    waiting.join(60)
    publisher.close()
    announcer.close()
    assert heard.posts == [(0, 0), (1, 0)] and store.latest() == VersionRef(0, 1)


def test_an_asynchronous_run_announces_an_offered_version_at_once_and_never_one_older_after_it(tmp_path):
    store, heard, publisher, announcer = announcing(tmp_path, background=True)
    announcer.published(0)  # not offered: the announcing thread posts it once the store has it
    time.sleep(0.3)
    assert heard.posts == []
    publisher.publish(1, trainer_state(1))  # version 0's write still held at the gate
    announcer.published(1, offered=True)  # the server on this GPU can take it now: the orchestrator hears at once
    assert heard.posts == [(1, 0)] and publisher.published is None
    store.gate.set()  # versions 0 and then 1 land in the store: neither is announced again, 0 not after 1
    publisher.close()
    announcer.close()
    assert heard.posts == [(1, 0)] and store.latest() == VersionRef(0, 1)
