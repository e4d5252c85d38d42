"""Fixtures shared by the RL tests: in-process rollout servers, endpoints that answer like them, a one-process
gloo world."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from fake_rollout import FakeRollouts
from rl_helpers import serve_rollout, tiny_run

from moe_rl_eks.workloads.model import MoETransformer


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fakes():
    """make(count, **endpoint settings) -> FakeRollouts (fake_rollout.py), all closed after the test."""
    made = []

    def make(count, **kw):
        made.append(FakeRollouts(count, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.fixture
def rollout(tmp_path):
    """An in-process rollout server (FastAPI on loopback) serving version 0 of a tiny model."""
    yield from serve_rollout(tmp_path)


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


@pytest.fixture
def model(tmp_path):
    """The tiny run's model, seeded, in eval mode (the engine and generation tests decode with it)."""
    run = tiny_run(tmp_path)
    torch.manual_seed(0)
    return MoETransformer(run.model).eval()
