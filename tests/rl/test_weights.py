"""Weight store: lineage and LATEST, atomic publication without copies, integrity (truncated file, missing shard,
wrong checksum, corrupted header, crash mid-publish), expert-parallel parts all or none; directory and S3 (moto's
server on loopback)."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from moe_rl_eks.workloads.model.checkpoint import MANIFEST, CheckpointError, load_hf, save_hf
from moe_rl_eks.workloads.model.safetensors_io import IntegrityError
from moe_rl_eks.workloads.rl.protocol import VersionRef
from moe_rl_eks.workloads.rl.weights import (
    AbandonedVersion,
    DirectoryStore,
    IncompleteVersion,
    S3Store,
    StaleVersion,
    version_name,
)
from moe_rl_eks.workloads.model import MoETransformer

V = VersionRef


@pytest.fixture(scope="module")
def model_config():
    from moe_rl_eks.core.run import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=64, dtype="float32")


def checkpoint(tmp_path, config, tag, value=None, **kwargs):
    """A Hugging Face checkpoint directory; every weight equal to `value` when given (to tell versions apart)."""
    torch.manual_seed(0)
    state = MoETransformer(config).state_dict()
    if value is not None:
        state = {k: torch.full_like(v, value) for k, v in state.items()}
    directory = tmp_path / f"src-{tag}"
    save_hf(state, config, directory, **kwargs)
    return directory


def visible(store) -> list[str]:
    return sorted(p.name for p in store.root.iterdir() if not p.name.startswith("."))


def weight(directory) -> float:
    return load_hf(directory)[1]["model.norm.weight"][0].item()


def test_publish_fetch_and_keep_the_newest_versions_of_the_lineage(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store", keep_versions=2)
    assert store.latest() is None
    for v in range(3):
        store.publish(v, checkpoint(tmp_path, model_config, v, value=v), lineage=0)
    assert store.latest() == V(0, 2)
    assert weight(store.fetch(V(0, 2), tmp_path)) == 2.0
    assert weight(store.fetch(2, tmp_path)) == 2.0  # a plain number: that version of LATEST's lineage
    assert visible(store) == ["LATEST", version_name(V(0, 1)), version_name(V(0, 2))]
    with pytest.raises(IncompleteVersion, match="not published"):
        store.fetch(V(0, 0), tmp_path)


def test_republishing_an_existing_version_is_a_no_op(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, checkpoint(tmp_path, model_config, "a", value=1.0), lineage=0)
    store.publish(1, checkpoint(tmp_path, model_config, "b", value=7.0), lineage=0)
    assert weight(store.fetch(V(0, 1), tmp_path)) == 1.0 and store.latest() == V(0, 1)


def test_latest_moves_forward_only_and_an_older_version_is_refused(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store", keep_versions=2)
    source = checkpoint(tmp_path, model_config, "a")
    for v in (3, 4, 5):
        store.publish(v, source, lineage=0)
    with pytest.raises(StaleVersion, match=r"older than LATEST VersionRef\(lineage=0, version=5\)"):
        store.publish(2, source, lineage=0)  # pruned long ago: must not come back, LATEST must not move back
    store.publish(3, source, lineage=1)  # a restart from checkpoint 3: a new lineage
    with pytest.raises(StaleVersion):
        store.publish(6, source, lineage=0)  # the dead lineage's trainer, still running
    assert store.latest() == V(1, 3)


def test_a_latest_pointer_of_the_old_format_is_refused_naming_the_file(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    (store.root / "LATEST").write_text("5")
    with pytest.raises(IncompleteVersion, match=r"store/LATEST: '5' is not a LATEST pointer; expected"):
        store.latest()


def test_a_new_lineage_replaces_the_dead_lineages_version_of_the_same_number(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store", keep_versions=3)
    for v in range(6):
        store.publish(v, checkpoint(tmp_path, model_config, f"0-{v}", value=float(v)), lineage=0)
    store.publish(3, checkpoint(tmp_path, model_config, "1-3", value=30.0), lineage=1)
    assert store.latest() == V(1, 3)
    assert weight(store.fetch(3, tmp_path)) == 30.0
    with pytest.raises(IncompleteVersion):  # the dead lineage's versions are gone, even the newer numbers
        store.fetch(V(0, 5), tmp_path)
    assert visible(store) == ["LATEST", version_name(V(1, 3))]


def test_publishing_a_directory_on_the_stores_filesystem_copies_nothing(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    source = checkpoint(tmp_path, model_config, "a")
    store.publish(0, source, lineage=0)
    for name in ("model.safetensors", "config.json"):
        assert os.stat(source / name).st_ino == os.stat(store.fetch(0, tmp_path) / name).st_ino  # hard links


def test_the_manifest_holds_the_checksums_the_writer_computed(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    staged = checkpoint(tmp_path, model_config, "a")
    with store.stage(V(0, 0)) as staging:
        staging.facts.update(save_hf(MoETransformer(model_config).state_dict(), model_config, staging.directory))
    files = json.loads((store.fetch(0, tmp_path) / MANIFEST).read_text())["files"]
    assert set(files) == {"model.safetensors", "config.json"} and staged.exists()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in files["model.safetensors"]["xxh3_64"]


def test_a_failed_publication_leaves_no_version_and_no_staging_files(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, checkpoint(tmp_path, model_config, "a"), lineage=0)
    with pytest.raises(FileNotFoundError):
        store.publish(2, tmp_path / "missing", lineage=0)
    assert store.latest() == V(0, 1) and [p.name for p in store.root.iterdir() if p.name.startswith(".")] == [".lock"]


def test_a_truncated_file_fails_the_fetch(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(0, checkpoint(tmp_path, model_config, "a", max_shard_bytes=20_000), lineage=0)
    shard = sorted((store.root / version_name(V(0, 0))).glob("*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(IncompleteVersion, match=f"{shard.name}: .* bytes; version .* says"):
        store.fetch(0, tmp_path)


def test_a_missing_shard_fails_the_fetch_and_the_load(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(0, checkpoint(tmp_path, model_config, "a", max_shard_bytes=20_000), lineage=0)
    directory = store.root / version_name(V(0, 0))
    shard = sorted(directory.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(IncompleteVersion, match=f"{shard.name}: missing"):
        store.fetch(0, tmp_path)
    with pytest.raises(ValueError, match=f"missing weights file {shard.name}"):
        load_hf(directory)


def published(tmp_path, model_config):
    """A store holding version 0 of lineage 0, that version's directory and its one weights file."""
    store = DirectoryStore(tmp_path / "store")
    store.publish(0, checkpoint(tmp_path, model_config, "a"), lineage=0)
    directory = store.fetch(0, tmp_path)
    return store, directory, directory / "model.safetensors"


def test_a_wrong_checksum_fails_the_load_naming_the_tensor(tmp_path, model_config):
    store, directory, shard = published(tmp_path, model_config)
    facts = json.loads((directory / MANIFEST).read_text())["files"]["model.safetensors"]
    with open(shard, "r+b") as f:  # flip one byte of the last tensor: same size, so only a checksum sees it
        f.seek(facts["bytes"] - 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    store.fetch(0, tmp_path)  # sizes only: no hashing pass
    with pytest.raises(IntegrityError, match=r"model.safetensors: tensor lm_head.weight does not match the manifest's checksum"):
        load_hf(directory)


def test_an_ep_rank_reads_only_its_experts_bytes(tmp_path, model_config):
    """Expert 0's bytes are damaged: the rank holding experts 2-3 never reads them, so it loads; a whole read fails."""
    from moe_rl_eks.workloads.model.safetensors_io import read_header

    _, directory, shard = published(tmp_path, model_config)
    head, pieces = read_header(shard)
    piece = next(p for p in pieces if p.name == "model.layers.0.mlp.experts.0.up_proj.weight")
    with open(shard, "r+b") as f:
        f.seek(len(head) + piece.start)
        f.write(b"\xff" * 8)
    _, state = load_hf(directory, experts=range(2, 4))
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2
    with pytest.raises(IntegrityError, match="experts.0.up_proj.weight"):
        load_hf(directory)


def test_a_corrupted_header_fails_the_load(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(0, checkpoint(tmp_path, model_config, "a"), lineage=0)
    shard = store.root / version_name(V(0, 0)) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[20] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="header"):
        load_hf(shard.parent)


def test_a_tensor_of_an_unsupported_dtype_is_refused_naming_it(tmp_path):
    import struct

    from moe_rl_eks.workloads.model.safetensors_io import CheckpointFormatError, read_header

    header = json.dumps({"w": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CheckpointFormatError, match="tensor w: dtype 'F8_E8M0' is not supported; expected one of"):
        read_header(path)


def test_a_partial_read_aligns_every_tensor_whatever_the_gaps_between_them(tmp_path):
    import struct

    from moe_rl_eks.workloads.model.safetensors_io import read_file

    header = json.dumps({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
                         "skipped": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [3, 7]}}).encode()
    path = tmp_path / "x.safetensors"
    data = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).tolist() + [7] + \
        torch.tensor([2.25]).view(torch.uint8).tolist()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data))
    got = read_file(path, lambda name: name != "skipped", torch.device("cpu"))
    assert got["a"].item() == 1.5 and got["b"].item() == 2.25 and "skipped" not in got


CRASH = """
import os, sys
from pathlib import Path
from moe_rl_eks.workloads.rl.weights import DirectoryStore
from moe_rl_eks.workloads.rl.protocol import VersionRef
store = DirectoryStore(sys.argv[1])
with store.stage(VersionRef(0, 2)) as staging:
    for path in Path(sys.argv[2]).iterdir():
        data = path.read_bytes()
        (staging.directory / path.name).write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), 9)  # killed mid-publish: half a file written, nothing committed
"""


def test_a_trainer_killed_mid_publish_leaves_no_readable_version(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, checkpoint(tmp_path, model_config, "a"), lineage=0)
    source = checkpoint(tmp_path, model_config, "b", value=2.0)
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(store.root), str(source)], env=os.environ)
    assert crashed.returncode == -9
    assert store.latest() == V(0, 1)
    with pytest.raises(IncompleteVersion):
        store.fetch(2, tmp_path)
    store.publish(2, source, lineage=0)  # the next trainer publishes the same version cleanly
    assert weight(store.fetch(2, tmp_path)) == 2.0
    assert not [p for p in store.root.iterdir() if p.name.startswith(".staging")]  # the crash's leftovers went


LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()  # hold the store's lock until told
"""


def test_a_commit_waits_for_a_publisher_in_another_process_holding_the_store(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store")
    source = checkpoint(tmp_path, model_config, "a")
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(store.root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    done = threading.Event()
    publisher = threading.Thread(target=lambda: (store.publish(0, source, lineage=0), done.set()))
    publisher.start()
    assert not done.wait(1.0) and store.latest() is None  # staged, but the commit waits for the lock
    holder.communicate("go\n", timeout=30)
    publisher.join(timeout=30)
    assert done.is_set() and store.latest() == V(0, 0)


def test_a_concurrent_reader_never_sees_a_half_written_version(tmp_path, model_config):
    store = DirectoryStore(tmp_path / "store", keep_versions=3)
    sources = [checkpoint(tmp_path, model_config, v, value=float(v)) for v in range(10)]
    store.publish(0, sources[0], lineage=0)
    seen, errors, done = [], [], threading.Event()

    def reader():
        while not done.is_set():
            ref = store.latest()
            try:
                state = load_hf(store.fetch(ref, tmp_path))[1]
            except (IncompleteVersion, CheckpointError, OSError) as exc:  # pruned while this reader lagged behind:
                if store.latest().version - ref.version < 2:  # only possible for versions no longer kept
                    errors.append(exc)
                continue
            seen.append(ref.version)
            if not all(torch.all(t == float(ref.version)) for t in state.values()):
                errors.append(f"version {ref} read with other weights")

    t = threading.Thread(target=reader)
    t.start()
    for v, source in enumerate(sources[1:], start=1):
        store.publish(v, source, lineage=0)
    done.set()
    t.join(timeout=30)
    assert not errors and seen and seen == sorted(seen)


def stage_part(store, ref, part, parts, source, files):
    with store.stage(ref, part=part, parts=parts) as staging:
        for name in files:
            (staging.directory / name).write_bytes((source / name).read_bytes())


@pytest.fixture(params=["directory", "s3"])
def any_store(request, tmp_path):
    if request.param == "directory":
        return DirectoryStore(tmp_path / "store")
    url = request.getfixturevalue("s3_url")
    return S3Store("weights", "run1/weights", endpoint_url=url, chunk_mib=5)


def test_expert_parallel_parts_publish_all_together(tmp_path, model_config, any_store):
    source = checkpoint(tmp_path, model_config, "a", value=4.0, max_shard_bytes=20_000)
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    other = threading.Thread(target=stage_part, args=(any_store, V(0, 0), 1, 2, source, shards[1:]))
    other.start()
    with any_store.stage(V(0, 0), part=0, parts=2) as staging:
        stage_part_files = [n for n in os.listdir(source) if n not in shards[1:]]
        for name in stage_part_files:
            (staging.directory / name).write_bytes((source / name).read_bytes())
        staging.facts.update(staging.collect_parts(timeout_s=30))
    other.join()
    assert any_store.latest() == V(0, 0)
    assert weight(any_store.fetch(0, tmp_path / "cache")) == 4.0


def test_an_expert_parallel_version_some_rank_skipped_is_published_by_none(tmp_path, model_config, any_store):
    source = checkpoint(tmp_path, model_config, "a")
    any_store.publish(0, source, lineage=0)
    any_store.skip(V(0, 1), part=1)
    with pytest.raises(AbandonedVersion, match="rank 1 skipped"):
        with any_store.stage(V(0, 1), part=0, parts=2) as staging:
            (staging.directory / "config.json").write_bytes((source / "config.json").read_bytes())
            staging.collect_parts(timeout_s=30)
    assert any_store.latest() == V(0, 0)
    with pytest.raises(IncompleteVersion):
        any_store.fetch(1, tmp_path / "cache")


@pytest.fixture
def s3_url(s3_endpoint):
    """conftest's moto server, emptied (its state is per process) and with the bucket `weights`."""
    import urllib.request

    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST"))
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="weights")
    return s3_endpoint


def test_s3_store_publishes_manifest_last_keeps_the_newest_and_verifies(tmp_path, s3_url, model_config):
    store = S3Store("weights", "run1/weights", endpoint_url=s3_url, keep_versions=2)
    for v in range(3):
        store.publish(v, checkpoint(tmp_path, model_config, v, value=float(v)), lineage=0)
    assert store.latest() == V(0, 2) and weight(store.fetch(2, tmp_path / "cache")) == 2.0
    keys = [o["Key"] for o in store.s3.list_objects_v2(Bucket="weights", Prefix="run1/")["Contents"]]
    assert not [k for k in keys if version_name(V(0, 0)) in k]  # pruned
    with pytest.raises(IncompleteVersion):
        store.fetch(0, tmp_path / "cache")
    with pytest.raises(StaleVersion):  # pruned: it must not come back
        store.publish(0, checkpoint(tmp_path, model_config, "old"), lineage=0)


def test_s3_latest_is_not_moved_back_by_a_publisher_that_lost_the_race_to_a_new_lineage(tmp_path, s3_url,
                                                                                       model_config):
    old = S3Store("weights", "run", endpoint_url=s3_url)
    new = S3Store("weights", "run", endpoint_url=s3_url)
    old.publish(5, checkpoint(tmp_path, model_config, "a", value=5.0), lineage=0)
    original = old.s3.put_object
    restarted = checkpoint(tmp_path, model_config, "b", value=30.0)

    def put_object(**kwargs):  # the restarted trainer commits between the old one's LATEST read and its write
        if kwargs["Key"] == "run/LATEST" and not new.latest() == V(1, 3):
            new.publish(3, restarted, lineage=1)
        return original(**kwargs)

    old.s3.put_object = put_object
    with pytest.raises(StaleVersion, match=r"older than LATEST VersionRef\(lineage=1, version=3\)"):
        old.publish(6, checkpoint(tmp_path, model_config, "c", value=6.0), lineage=0)
    assert new.latest() == V(1, 3) and weight(new.fetch(3, tmp_path / "cache")) == 30.0
    with pytest.raises(IncompleteVersion):  # the loser's objects went with it
        new.fetch(V(0, 6), tmp_path / "cache")


def test_s3_uploads_are_multipart_with_crc32_checksums_that_s3_verified(tmp_path, s3_url, model_config):
    store = S3Store("weights", "w", endpoint_url=s3_url, chunk_mib=5)
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "big.bin").write_bytes(os.urandom(12 << 20))  # 3 parts of 5 MiB
    store.publish(0, source, lineage=0)
    key = f"w/{version_name(V(0, 0))}/big.bin"
    head = store.s3.head_object(Bucket="weights", Key=key, ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32") and head["ETag"].strip('"').endswith("-3")
    fetched = store.fetch(0, tmp_path / "cache")
    assert (fetched / "big.bin").read_bytes() == (source / "big.bin").read_bytes()


def test_s3_takes_a_file_image_from_memory_in_checksummed_parts_and_the_reader_verifies_it(tmp_path, s3_url):
    from moe_rl_eks.workloads.model.safetensors_io import Source, plan_files, read_file

    store = S3Store("weights", "w", endpoint_url=s3_url, chunk_mib=5)
    pieces = tuple((f"t{i}", (3 << 20,)) for i in range(4))  # 12 MiB of uint8: three parts of 5 MiB
    (layout,) = plan_files([Source("blob", torch.uint8, (12 << 20,), pieces)], lambda i, n: "blob.safetensors",
                           max_file_bytes=1 << 30)
    image = torch.empty(layout.size, dtype=torch.uint8)
    image[len(layout.header):] = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8)
    with store.stage(V(0, 0)) as staging:
        staging.put(memoryview(image.numpy()), layout)
        assert not list(staging.directory.iterdir())  # nothing went through the local disk
    key = f"w/{version_name(V(0, 0))}/blob.safetensors"
    head = store.s3.head_object(Bucket="weights", Key=key, ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32") and head["ETag"].strip('"').endswith("-3")
    directory = store.fetch(0, tmp_path / "cache")
    facts = json.loads((directory / MANIFEST).read_text())["files"]
    tensors = read_file(directory / "blob.safetensors", lambda name: True, torch.device("cpu"),
                        facts["blob.safetensors"])
    assert torch.equal(torch.cat([tensors[f"t{i}"] for i in range(4)]), image[len(layout.header):])


def test_s3_upload_that_dies_before_the_manifest_publishes_nothing(tmp_path, s3_url, model_config, monkeypatch):
    store = S3Store("weights", "w", endpoint_url=s3_url)
    store.publish(1, checkpoint(tmp_path, model_config, "a"), lineage=0)
    calls = []
    original = store.s3.upload_file

    def dying_upload(filename, bucket, key, **kwargs):
        calls.append(key)
        if len(calls) == 2:
            raise ConnectionError("network dropped mid-upload")
        return original(filename, bucket, key, **kwargs)

    monkeypatch.setattr(store.s3, "upload_file", dying_upload)
    monkeypatch.setattr(store, "files_in_parallel", 1)
    with pytest.raises(ConnectionError):
        store.publish(2, checkpoint(tmp_path, model_config, "b"), lineage=0)
    assert store.latest() == V(0, 1)
    with pytest.raises(IncompleteVersion, match="version"):
        store.fetch(2, tmp_path / "cache")
    keys = [o["Key"] for o in store.s3.list_objects_v2(Bucket="weights", Prefix="w/")["Contents"]]
    assert not [k for k in keys if version_name(V(0, 2)) in k]  # the uploaded half was removed


def test_a_rollout_engine_reads_an_s3_version_and_keeps_no_download(tmp_path, s3_url):
    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.rollout.engine import RolloutEngine
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer

    run = tiny_run(tmp_path)
    state = MoETransformer(run.model).state_dict()
    save_hf(state, run.model, tmp_path / "src")
    store = S3Store("weights", "run1/weights", endpoint_url=s3_url)
    store.publish(0, tmp_path / "src", lineage=0)
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())
    try:
        engine.load_version(0)
        assert engine.version == 0
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in state.items())
        assert not any((tmp_path / "cache").iterdir())  # read into memory, the download is gone
    finally:
        engine.stop()
