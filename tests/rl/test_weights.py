"""Weight store: atomic publication, manifest verification, directory and S3 (moto's server on loopback)."""
import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl_eks.workloads.rl.weights import MANIFEST, DirectoryStore, IncompleteVersion, S3Store, version_name


def hf_dir(tmp_path, version, size=1000):
    d = tmp_path / f"src{version}"
    d.mkdir()
    save_file({"w": torch.full((size,), float(version))}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return d


def publish_three_and_fetch_the_newest(store, tmp_path):
    assert store.latest() is None
    for v in range(3):
        store.publish(v, hf_dir(tmp_path, v))
    assert store.latest() == 2
    got = store.fetch(2, tmp_path / "cache")
    assert load_file(str(got / "model.safetensors"))["w"][0].item() == 2.0
    return got


def test_directory_store_publishes_verifies_and_keeps_the_newest_versions(tmp_path):
    store = DirectoryStore(tmp_path / "store", keep_versions=2)
    got = publish_three_and_fetch_the_newest(store, tmp_path)
    assert set(json.loads((got / MANIFEST).read_text())["files"]) == {"model.safetensors", "config.json"}
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["LATEST", version_name(1), version_name(2)]
    with pytest.raises(IncompleteVersion, match="version 0"):
        store.fetch(0, tmp_path / "cache")


def test_directory_store_republishing_a_version_is_a_no_op(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, hf_dir(tmp_path, 1))
    store.publish(1, hf_dir(tmp_path, 7))
    assert load_file(str(store.fetch(1, tmp_path) / "model.safetensors"))["w"][0].item() == 1.0


def test_a_failed_publication_leaves_no_version_and_no_staging_files(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, hf_dir(tmp_path, 1))
    with pytest.raises(FileNotFoundError):
        store.publish(2, tmp_path / "missing")
    assert store.latest() == 1 and [p.name for p in (tmp_path / "store").iterdir() if p.name.startswith(".")] == []


def test_a_corrupted_file_fails_verification(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    store.publish(1, hf_dir(tmp_path, 1))
    (tmp_path / "store" / version_name(1) / "config.json").write_text("{}")
    with pytest.raises(IncompleteVersion, match="config.json"):
        store.fetch(1, tmp_path)


def test_concurrent_reader_never_sees_a_half_written_version(tmp_path):
    store = DirectoryStore(tmp_path / "store", keep_versions=3)
    store.publish(0, hf_dir(tmp_path, 0, size=200_000))
    sources = [hf_dir(tmp_path, v, size=200_000) for v in range(1, 13)]
    seen, errors, done = [], [], threading.Event()

    def reader():
        while not done.is_set():
            v = store.latest()
            try:
                w = load_file(str(store.fetch(v, tmp_path) / "model.safetensors"))["w"]
                seen.append(v)
                assert torch.all(w == float(v))
            except IncompleteVersion as exc:  # pruned between latest() and fetch: only possible for old versions
                if store.latest() - v < 2:
                    errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for v, src in enumerate(sources, start=1):
        store.publish(v, src)
    done.set()
    t.join(timeout=30)
    assert not errors and seen and seen == sorted(seen)


@pytest.fixture
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import boto3
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="weights")
    yield url
    server.stop()


def test_s3_store_publishes_manifest_last_and_verifies_on_fetch(tmp_path, s3_endpoint):
    store = S3Store("weights", "run1/weights", endpoint_url=s3_endpoint, keep_versions=2)
    publish_three_and_fetch_the_newest(store, tmp_path)
    keys = [o["Key"] for o in store.s3.list_objects_v2(Bucket="weights")["Contents"]]
    assert not [k for k in keys if "/v00000000/" in k]  # pruned
    with pytest.raises(IncompleteVersion):
        store.fetch(0, tmp_path / "cache")


def test_s3_upload_that_dies_before_the_manifest_publishes_nothing(tmp_path, s3_endpoint, monkeypatch):
    store = S3Store("weights", "w", endpoint_url=s3_endpoint)
    store.publish(1, hf_dir(tmp_path, 1))
    calls = []

    def dying_upload(filename, bucket, key):
        calls.append(key)
        if len(calls) == 2:
            raise ConnectionError("network dropped mid-upload")
        return original(filename, bucket, key)

    original = store.s3.upload_file
    monkeypatch.setattr(store.s3, "upload_file", dying_upload)
    with pytest.raises(ConnectionError):
        store.publish(2, hf_dir(tmp_path, 2))
    assert store.latest() == 1
    with pytest.raises(IncompleteVersion, match="version 2"):
        store.fetch(2, tmp_path / "cache")


def test_a_rollout_engine_reads_an_s3_version_and_keeps_no_download(tmp_path, s3_endpoint):
    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.rl.rollout_server import RolloutEngine
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer

    run = tiny_run(tmp_path)
    state = MoETransformer(run.model).state_dict()
    save_hf(state, run.model, tmp_path / "src")
    store = S3Store("weights", "run1/weights", endpoint_url=s3_endpoint)
    store.publish(0, tmp_path / "src")
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())
    try:
        engine.load_version(0)
        assert engine.version == 0
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in state.items())
        assert not any((tmp_path / "cache").iterdir())  # read into memory, the download is gone
    finally:
        engine.stop()
