"""Fixtures shared by the RL tests: in-process rollout servers, a one-process gloo world."""
from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist
from rl_helpers import publish_initial, tiny_run


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def rollout(tmp_path):
    """An in-process rollout server (HTTP on loopback) serving version 0 of a tiny model."""
    from moe_rl_eks.workloads.rl.rollout_server import RolloutEngine, make_server
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    run = tiny_run(tmp_path, sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
    store = DirectoryStore(tmp_path / "weights")
    publish_initial(run, store)
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())
    engine.load_version(0)
    server = make_server(run, engine, "127.0.0.1", 0, token="s3cret")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "engine": engine, "store": store, "run": run}
    server.shutdown()
    engine.stop()


@pytest.fixture
def s3_endpoint(monkeypatch):
    """moto's S3 server on 127.0.0.1 with test credentials; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
