"""A serving replica's load path (workloads/rollout/weight_staging.py): each version is read, verified, into host staging
buffers kept across versions (pinned with CUDA, plain here: the same logic), and only then copied into the served
tensors in place (the first load into a model allocated uninitialized); a version that fails leaves the previous
one served; the staging follows the files a version has. The CUDA test runs only where a GPU is."""
import dataclasses

import pytest
import torch
from rl_helpers import tiny_run

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.safetensors_io import read_header
from moe_rl_eks.workloads.trainer.publisher import Publisher
from moe_rl_eks.workloads.rollout.replica import Replica, SwapRefused
from moe_rl_eks.workloads.rl.weights import DirectoryStore


@pytest.fixture
def run(tmp_path):
    run = tiny_run(tmp_path)
    return dataclasses.replace(run, model=dataclasses.replace(run.model, router="sigmoid", dtype="bfloat16"))


def trainer_state(run, seed):
    torch.manual_seed(seed)
    state = MoETransformer(run.model).state_dict()
    for name, tensor in state.items():
        if name.endswith("e_score_correction_bias"):  # float32, moved by ~1e-3 steps: must stay bit-equal
            tensor.copy_(torch.randn_like(tensor) * 1e-3 + 0.5)
    return state


def publish(store, run, states: dict[int, dict], max_shard_bytes=5 * 2**30):
    publisher = Publisher(store, run.model, lineage=0, max_shard_bytes=max_shard_bytes)
    for version, state in states.items():
        publisher.publish(version, state)
        publisher.flush()
    publisher.close()


def served_equals(replica, state) -> bool:
    held = replica.model.state_dict()
    return all(torch.equal(held[k], v.to(held[k].dtype)) for k, v in state.items())


def corrupt_one_byte(directory):
    shard = sorted(directory.glob("*.safetensors"))[0]
    head, pieces = read_header(shard)
    with open(shard, "r+b") as f:
        f.seek(len(head) + pieces[-1].start)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def serving_version_1(tmp_path, run, versions):
    """A store holding `versions` of the trainer's state and a CPU replica serving version 1 of them."""
    store = DirectoryStore(tmp_path / "store", keep_versions=5)
    states = {v: trainer_state(run, v) for v in versions}
    publish(store, run, states)
    replica = Replica(run, device=torch.device("cpu"))
    replica.begin_read(1, str(store.fetch(1, tmp_path))).result()
    replica.swap(1)
    return store, states, replica


def test_each_version_is_read_into_the_same_staging_and_copied_into_the_same_served_tensors(tmp_path, run):
    store, states, replica = serving_version_1(tmp_path, run, (1, 2))
    try:
        assert served_equals(replica, states[1])
        served_at = {k: v.data_ptr() for k, v in replica.model.state_dict().items()}
        staging_at = {name: b.data_ptr() for name, b in replica.staging.buffers.items()}
        read = replica.begin_read(2, str(store.fetch(2, tmp_path))).result().state
        # No second host copy: every tensor read is a view of a staging buffer, the same buffers as version 1's.
        assert {name: b.data_ptr() for name, b in replica.staging.buffers.items()} == staging_at
        bases = {b.untyped_storage().data_ptr() for b in replica.staging.buffers.values()}
        assert all(t.untyped_storage().data_ptr() in bases for t in read.values())
        assert served_equals(replica, states[1])  # reading does not touch what is served
        del read
        replica.swap(2)
        assert served_equals(replica, states[2]) and replica.version == 2
        assert {k: v.data_ptr() for k, v in replica.model.state_dict().items()} == served_at  # in place
        bias = "model.layers.0.mlp.gate.e_score_correction_bias"
        assert replica.model.state_dict()[bias].dtype == torch.float32
        assert torch.equal(replica.model.state_dict()[bias], states[2][bias])
    finally:
        replica.stop()
    assert replica.staging.buffers == {}  # stop() frees (and with CUDA unpins) the staging


def test_a_version_failing_its_checksum_leaves_the_previous_one_served_and_the_next_one_loads(tmp_path, run):
    store, states, replica = serving_version_1(tmp_path, run, (1, 2, 3))
    corrupt_one_byte(store.fetch(2, tmp_path))
    try:
        replica.begin_read(2, str(store.fetch(2, tmp_path))).exception()  # overwrote part of the staging
        with pytest.raises(SwapRefused, match="does not match the manifest's checksum"):
            replica.swap(2)
        assert replica.version == 1 and served_equals(replica, states[1])
        replica.begin_read(3, str(store.fetch(3, tmp_path))).result()
        replica.swap(3)
        assert replica.version == 3 and served_equals(replica, states[3])
    finally:
        replica.stop()


def test_a_swap_of_a_version_other_than_the_one_read_is_refused_and_changes_nothing(tmp_path, run):
    store, states, replica = serving_version_1(tmp_path, run, (1, 2))
    try:
        replica.begin_read(2, str(store.fetch(2, tmp_path))).result()
        with pytest.raises(SwapRefused, match="version 3 of lineage 0 was not read first"):
            replica.swap(3)
        assert replica.version == 1 and served_equals(replica, states[1])
    finally:
        replica.stop()


def test_the_staging_follows_the_files_of_the_version_read(tmp_path, run):
    one_file, three_files = DirectoryStore(tmp_path / "a"), DirectoryStore(tmp_path / "b")
    state = trainer_state(run, 1)
    publish(one_file, run, {1: state})
    publish(three_files, run, {1: state}, max_shard_bytes=sum(t.numel() * 2 for t in state.values()) // 3)
    wide = sorted(p.name for p in three_files.fetch(1, tmp_path).glob("*.safetensors"))
    assert len(wide) > 2
    replica = Replica(run, device=torch.device("cpu"))
    try:
        replica.begin_read(1, str(one_file.fetch(1, tmp_path))).result()
        replica.swap(1)
        assert sorted(replica.staging.buffers) == ["model.safetensors"]
        replica.begin_read(2, str(three_files.fetch(1, tmp_path))).result()
        replica.swap(2)
        assert sorted(replica.staging.buffers) == wide  # the one-file version's buffer was freed
        assert served_equals(replica, state)
    finally:
        replica.stop()


def test_a_tied_lm_head_is_served_as_the_embedding_itself(tmp_path, run):
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, tie_word_embeddings=True))
    store = DirectoryStore(tmp_path / "store")
    state = trainer_state(run, 1)
    publish(store, run, {1: state})
    replica = Replica(run, device=torch.device("cpu"))
    try:
        replica.begin_read(1, str(store.fetch(1, tmp_path))).result()
        replica.swap(1)
        assert replica.model.lm_head.weight is replica.model.model.embed_tokens.weight
        assert served_equals(replica, state)
    finally:
        replica.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_on_a_gpu_the_staging_is_pinned_and_the_version_lands_bit_equal_on_the_device(tmp_path, run):
    store = DirectoryStore(tmp_path / "store", keep_versions=5)
    states = {1: trainer_state(run, 1), 2: trainer_state(run, 2)}
    publish(store, run, states)
    replica = Replica(run, device=torch.device("cuda"))
    try:
        for version in (1, 2):
            replica.begin_read(version, str(store.fetch(version, tmp_path))).result()
            replica.swap(version)
            assert all(b.is_pinned() for b in replica.staging.buffers.values())
            held = replica.model.state_dict()
            assert all(torch.equal(held[k].cpu(), v.to(held[k].dtype)) for k, v in states[version].items())
    finally:
        replica.stop()


def test_a_file_with_none_of_the_wanted_tensors_stages_nothing(tmp_path):
    # a serving rank reading a file another trainer rank wrote with only other experts: no buffer of 0 bytes
    from safetensors.torch import save_file

    from moe_rl_eks.workloads.model.safetensors_io import read_file
    from moe_rl_eks.workloads.rollout.weight_staging import HostStaging

    save_file({"model.layers.0.mlp.experts.5.down_proj.weight": torch.ones(2, 2)}, tmp_path / "rank-1.safetensors")
    staging = HostStaging(pin=False)
    assert read_file(tmp_path / "rank-1.safetensors", lambda name: False, torch.device("cpu"), into=staging) == {}
    assert staging.buffers == {}


def test_a_file_read_whole_with_o_direct_into_the_staging_has_the_bytes_the_page_cache_read_gives(tmp_path, run):
    # The served checkpoint's path: every tensor of each file wanted, read whole into a block-aligned buffer
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.model.safetensors_io import DIRECT_ALIGN, IntegrityError, read_file
    from moe_rl_eks.workloads.rollout.weight_staging import HostStaging

    state = trainer_state(run, 3)
    save_hf(state, run.model, tmp_path / "ckpt", max_shard_bytes=1 << 16)  # several files of odd sizes
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) > 1 and any(f.stat().st_size % DIRECT_ALIGN for f in files)
    staging = HostStaging(pin=False)
    for path in files:
        direct = read_file(path, lambda name: True, torch.device("cpu"), into=staging)
        # read whole (the direct layout: the file's bytes from offset 0, rounded up to whole blocks)
        assert staging.buffers[path.name].numel() == -(-path.stat().st_size // DIRECT_ALIGN) * DIRECT_ALIGN
        cached = read_file(path, lambda name: True, torch.device("cpu"))
        assert direct.keys() == cached.keys() and direct
        assert all(torch.equal(direct[k].view(torch.uint8), cached[k].view(torch.uint8)) for k in direct)
    with open(files[0], "r+b") as f:
        f.truncate(files[0].stat().st_size - 3)
    with pytest.raises(IntegrityError, match="before the data its header describes"):
        read_file(files[0], lambda name: True, torch.device("cpu"), into=staging)
