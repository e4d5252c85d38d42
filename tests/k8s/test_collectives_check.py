"""The validation chart's collectives check, run for real: torchrun, 2 gloo ranks on this CPU."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from manifest_helpers import ROOT

SCRIPT = ROOT / "k8s" / "scripts" / "collectives_check.py"


def test_reports_bus_bandwidth_and_fails_when_efa_was_expected_but_not_used(tmp_path):
    env = {**os.environ, "FI_PROVIDER": "efa", "OMP_NUM_THREADS": "1"}  # as on an EFA node; gloo is not EFA
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(SCRIPT),
         "--min-bytes=4096", "--max-bytes=65536", "--iters=2", "--warmup=1"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout
    rows = re.findall(r"^(all_reduce|all_to_all)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [(op, int(size)) for op, size, *_ in rows] == [
        (op, size) for size in (4096, 16384, 65536) for op in ("all_reduce", "all_to_all")], out + proc.stderr
    for op, _, _, algbw, busbw in rows:
        factor = 2 * (2 - 1) / 2 if op == "all_reduce" else (2 - 1) / 2  # nccl-tests' factors for 2 ranks
        assert float(busbw) == pytest.approx(float(algbw) * factor, abs=0.011)
    assert re.search(r"network per rank: 0:\S+:gloo, 1:\S+:gloo", out)
    assert "EFA expected: True; FAILED on" in out
    assert proc.returncode == 1


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("collectives_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("log, expected", [
    ("NCCL INFO NET/OFI Using Libfabric version 2.1\nNCCL INFO NET/OFI Selected provider is efa, fabric is efa "
     "(found 32 nics)\nNCCL INFO Using network AWS Libfabric\n", "efa"),
    ("NCCL INFO NET/Plugin: Could not find: libnccl-net.so\nNCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>\n",
     "socket"),
    ("NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.14.0\nNCCL INFO NET/OFI No eligible providers were found\n"
     "NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>\n", "socket"),
    ("NCCL INFO Bootstrap : Using eth0:10.0.0.5<0>\n", "unknown"),
])
def test_reads_the_selected_network_from_nccls_log(check, tmp_path, monkeypatch, log, expected):
    (tmp_path / f"nccl.{check.socket.gethostname()}.{os.getpid()}.log").write_text(log)
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.%h.%p.log"))
    assert check.network_in_use("nccl") == expected
