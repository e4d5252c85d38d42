"""Weight versions between a trainer and a rollout server on one GPU, through device memory
(workloads/rl/device_weights.py), run on the CPU through the same protocol: a rollout server in another process
(spawned, its own interpreter) takes each version the trainer offers over the authenticated Unix socket, its
tensors opened from the trainer's shared memory (torch's reductions; CUDA IPC handles on a GPU), installs it and
releases it. Versions land bit-equal and in order; the trainer does not overwrite an export a server holds (that
version goes through the store, which is written throughout); a version the trainer no longer offers is read from
the store; a peer without the run's key is refused."""
import dataclasses
import multiprocessing
import queue
import secrets

import pytest
import torch
from rl_helpers import tiny_run

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rl.device_weights import DeviceExporter, DeviceImporter, address
from moe_rl_eks.workloads.rl.protocol import VersionRef
from moe_rl_eks.workloads.rl.weights import DirectoryStore
from moe_rl_eks.workloads.trainer.publisher import Publisher

REPLY_TIMEOUT_S = 120  # the spawned server imports torch on a shared 2-core machine


def trainer_state(run, seed, device):
    torch.manual_seed(seed)
    # float32 masters on the trainer's device; served (and published) in bfloat16
    return {k: v.to(device) for k, v in MoETransformer(run.model).state_dict().items()}


def server(run, channel, device, commands, replies) -> None:
    """The rollout server's side, in its own process: a replica on `device` taking versions from the trainer's
    export (on a GPU through CUDA IPC handles)."""
    from moe_rl_eks.workloads.rollout.replica import Replica

    replica = Replica(run, device=torch.device(device), importer=DeviceImporter(*channel))
    for op, version, path in iter(commands.get, None):
        try:
            if op == "read":
                replies.put(replica.begin_read(version, path).result().via)
            else:
                replica.swap(version)
                replies.put((replica.version, {k: v.cpu() for k, v in replica.model.state_dict().items()}))
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            replies.put(f"{type(exc).__name__}: {exc}")
    replica.stop()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC handles need a GPU"))])
def colocated(tmp_path, request):
    """A trainer's side (store publisher and device exporter) and a server process connected to it, both on the
    CPU (shared memory) or on one GPU (CUDA IPC)."""
    device = request.param
    run = tiny_run(tmp_path)
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, router="sigmoid", dtype="bfloat16"))
    channel = (address(tmp_path), secrets.token_hex(16).encode())
    exporter = DeviceExporter(run.model, *channel)
    store = DirectoryStore(tmp_path / "store", keep_versions=5)
    publisher = Publisher(store, run.model, lineage=0)
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    process = context.Process(target=server, args=(run, channel, device, commands, replies), daemon=True)
    process.start()

    def ask(op, version):
        """Tell the server to read or swap `version`; its answer."""
        commands.put((op, version, str(store.fetch(version, tmp_path / "cache"))))
        try:
            return replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the server process did not answer {op} {version}") from None

    def publish(version):
        """The trainer's publish: the store (written, then the version announced), and the export."""
        state = trainer_state(run, version, device)
        publisher.publish(version, state)
        offered = exporter.export(VersionRef(0, version), state)
        publisher.flush()
        return state, offered

    yield run, exporter, publish, ask, channel
    commands.put(None)
    process.join(timeout=60)
    publisher.close()
    exporter.close(timeout_s=5)


def served_equals(served, state) -> bool:
    return served.keys() == state.keys() and all(torch.equal(served[k], v.cpu().to(served[k].dtype))
                                                 for k, v in state.items())


def test_versions_taken_from_the_trainers_export_land_bit_equal_and_in_order(colocated):
    run, exporter, publish, ask, _ = colocated
    for version in range(3):
        state, offered = publish(version)
        assert offered and exporter.offered == VersionRef(0, version)
        assert ask("read", version) == "device"
        served_version, served = ask("swap", version)
        assert served_version == version
        assert served_equals(served, state)
    assert exporter.not_offered == []


def test_the_trainer_does_not_overwrite_an_export_a_server_holds_and_that_version_comes_from_the_store(colocated):
    run, exporter, publish, ask, _ = colocated
    first, _ = publish(0)
    assert ask("read", 0) == "device"  # taken, not yet installed: the server holds the export
    second, offered = publish(1)
    assert not offered and exporter.not_offered == [VersionRef(0, 1)]
    assert exporter.offered == VersionRef(0, 0)  # the held export still has version 0's bytes
    served_version, served = ask("swap", 0)
    assert (served_version, served_equals(served, first)) == (0, True)
    assert ask("read", 1) == "store"  # the released export never held version 1: the store has it
    served_version, served = ask("swap", 1)
    assert (served_version, served_equals(served, second)) == (1, True)
    third, offered = publish(2)  # released: the export is written and offered again
    assert offered and ask("read", 2) == "device"
    served_version, served = ask("swap", 2)
    assert (served_version, served_equals(served, third)) == (2, True)


def test_a_version_the_trainer_no_longer_offers_is_read_from_the_store(colocated):
    run, exporter, publish, ask, _ = colocated
    older, _ = publish(0)
    publish(1)  # the export moved on to version 1 before the server asked for 0
    assert ask("read", 0) == "store"
    served_version, served = ask("swap", 0)
    assert (served_version, served_equals(served, older)) == (0, True)


def test_a_peer_without_the_runs_key_is_refused_and_the_exporter_goes_on_serving(colocated):
    run, exporter, publish, ask, (where, key) = colocated
    publish(0)
    assert DeviceImporter(where, b"not the key").take(VersionRef(0, 0)) is None
    assert ask("read", 0) == "device"
    assert ask("swap", 0)[0] == 0


def test_bench_weights_device_path_takes_three_versions_bit_equal_through_a_server_process(tmp_path):
    # tools/gpu_runs/h200-weights-ipc.sh runs this on the GPU at 8 layers of the 30B shape; here the CPU, tiny
    from moe_rl_eks.tools.bench.weights import device_swaps, serving_run

    run = tiny_run(tmp_path)
    config = dataclasses.replace(run.model, dtype="bfloat16")
    state = MoETransformer(config).state_dict()
    store = DirectoryStore(tmp_path / "store")
    publisher = Publisher(store, config, lineage=0)
    publisher.publish(0, state)
    publisher.close()
    directory = store.fetch(0, tmp_path / "cache")
    rows, mismatched = device_swaps(serving_run(directory), config, state, directory, torch.device("cpu"))
    assert mismatched == [] and [(r["version"], r["via"]) for r in rows] == [(0, "device"), (1, "device"),
                                                                             (2, "device")]
