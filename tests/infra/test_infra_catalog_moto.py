"""The EFA instance catalog agrees with EC2's describe_instance_types, as moto serves it on 127.0.0.1."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from moe_rl_eks.core.catalog import CATALOG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ec2():
    port = _free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        yield boto3.client("ec2", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{port}",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


def test_catalog_matches_describe_instance_types(ec2):
    described = {t["InstanceType"]: t for t in ec2.describe_instance_types(InstanceTypes=list(CATALOG))["InstanceTypes"]}
    assert set(described) == set(CATALOG)
    for name, entry in CATALOG.items():
        info = described[name]
        gpus = info["GpuInfo"]["Gpus"]
        network = info["NetworkInfo"]
        efa = network["EfaInfo"]["MaximumEfaInterfaces"] if network.get("EfaSupported") else 0
        assert (sum(g["Count"] for g in gpus), gpus[0]["MemoryInfo"]["SizeInMiB"]) == (entry.gpus, entry.gpu_memory_mib), name
        assert (network["MaximumNetworkCards"], efa) == (entry.network_cards, entry.efa_interfaces), name
        assert (info["VCpuInfo"]["DefaultVCpus"], info["MemoryInfo"]["SizeInMiB"] // 1024) == (entry.vcpus, entry.memory_gib), name
