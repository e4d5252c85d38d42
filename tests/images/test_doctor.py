"""`moerl doctor` on this CPU machine: the orchestrator role passes, the GPU roles report what is missing, one
line per blocker, and the exit status says whether the container may start."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl_eks.core.container import DEEPEP_EFA_NVSHMEM_ENV
from moe_rl_eks.tools import doctor
from moe_rl_eks.tools.doctor import Context, checks_for


def run_doctor(*args: str, env: dict[str, str] | None = None, shell_prefix: str = "") -> subprocess.CompletedProcess:
    command = " ".join([shell_prefix, sys.executable, "-m", "moe_rl_eks.tools.cli", "doctor", *args])
    environment = {k: v for k, v in os.environ.items() if k not in ("FI_PROVIDER", doctor.DEEPEP_VARIANT_ENV)}
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={**environment, **(env or {})},
                          timeout=120)


def lines_by_check(stdout: str) -> dict[str, tuple[str, str]]:
    """check name -> (status, detail) from the doctor's table."""
    out = {}
    for line in stdout.splitlines()[:-1]:
        status, rest = line.split(None, 1)
        name, detail = rest.split("  ", 1)
        out[name.strip()] = (status, detail.strip())
    return out


def test_orchestrator_role_is_ready_here_and_checks_no_gpu():
    result = run_doctor("--role", "orchestrator", env={"FI_PROVIDER": "efa"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(lines_by_check(result.stdout)) == {"entry point", "scratch"}
    assert result.stdout.splitlines()[-1] == "doctor --role orchestrator: ready"


def test_trainer_role_reports_the_missing_gpu_and_efa_as_blockers():
    result = run_doctor("--role", "trainer", env={"FI_PROVIDER": "efa"})  # auto: EFA expected, as on an EFA pod
    assert result.returncode == 1
    checks = lines_by_check(result.stdout)
    assert checks["gpu"][0] == "BLOCKER"
    assert checks["gpu"][1].startswith("no NVIDIA driver visible (libnvidia-ml.so.1")
    assert checks["nccl"] == ("BLOCKER", f"torch {__import__('torch').__version__} is a CPU build: no NCCL")
    assert checks["libfabric efa"] == ("BLOCKER", "fi_info not found: libfabric (EFA installer) is not in the image")
    assert checks["nccl net plugin"][1].startswith("libnccl-net-ofi.so does not load")
    assert checks["ep backends"] == ("BLOCKER", "MOERL_DEEPEP_VARIANT=''; the image must record one of efa-v1, "
                                                "stock-v1, none")
    assert checks["entry point"] == ("OK", "`moerl train` -> moe_rl_eks.workloads.trainer.loop.main")
    blockers = sum(status == "BLOCKER" for status, _ in checks.values())
    assert result.stdout.splitlines()[-1] == f"doctor --role trainer: {blockers} blocker(s)"


def test_locked_memory_limit_blocks_only_where_efa_is_expected():
    capped = "ulimit -S -l 64;"
    with_efa = lines_by_check(run_doctor("--role", "rollout", "--efa", shell_prefix=capped).stdout)
    without = lines_by_check(run_doctor("--role", "rollout", "--efa", "no", shell_prefix=capped).stdout)
    assert with_efa["ulimit -l"] == ("BLOCKER", "64 KiB; EFA memory registration needs unlimited locked memory "
                                                "(raise LimitMEMLOCK for containerd on the node)")
    assert without["ulimit -l"] == ("WARN", "64 KiB (fine without EFA)")
    assert "libfabric efa" not in without


def test_json_output_lists_every_check():
    result = run_doctor("--role", "orchestrator", "--json")
    report = json.loads(result.stdout)
    assert report["role"] == "orchestrator"
    assert [c["name"] for c in report["checks"]] == ["entry point", "scratch"]
    assert {c["status"] for c in report["checks"]} == {"ok"}


def test_unknown_role_is_a_usage_error_naming_the_roles():
    result = run_doctor("--role", "scheduler")
    assert result.returncode == 2
    assert "invalid choice: 'scheduler' (choose from 'trainer', 'rollout', 'orchestrator')" in result.stderr


GPU = ["check_gpus", "check_nccl", "check_memlock", "check_hugepages"]
EFA = ["check_efa_provider", "check_ofi_plugin", "check_ofi_tuner"]


@pytest.mark.parametrize("role, efa, expected", [
    ("orchestrator", True, []),
    ("rollout", False, GPU),
    ("rollout", True, GPU + EFA),
    ("trainer", False, GPU + ["check_deepep"]),
    ("trainer", True, GPU + EFA + ["check_deepep"]),
])
def test_each_role_runs_its_checks(role, efa, expected):
    assert [fn.__name__ for fn in checks_for(role, efa)] == ["check_entry_point", "check_scratch"] + expected


def test_scratch_that_cannot_be_written_is_a_blocker(tmp_path):
    missing = tmp_path / "not-mounted"
    check = doctor.check_scratch(Context(role="orchestrator", env={"TMPDIR": str(missing)}, expect_efa=False))
    assert check.status == "blocker"
    assert check.detail.startswith(f"{missing} is not writable")


@pytest.mark.parametrize("total, efa, status", [(0, True, "blocker"), (0, False, "warn"), (5120, True, "ok")])
def test_hugepages_from_meminfo(tmp_path, total, efa, status):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       2097152 kB\nHugePages_Total:   {total}\nHugePages_Free:    {total}\n"
                       "Hugepagesize:       2048 kB\n")
    check = doctor.check_hugepages(Context(role="trainer", env={}, expect_efa=efa, meminfo=meminfo))
    assert check.status == status
    assert check.detail.startswith(f"{total} x 2 MiB reserved, {total} free")


def test_a_run_resolved_to_deepep_needs_an_image_with_it():
    env = {doctor.DEEPEP_VARIANT_ENV: "none", doctor.EP_BACKEND_ENV: "deepep"}
    check = doctor.check_deepep(Context(role="trainer", env=env, expect_efa=False))
    assert (check.status, check.detail) == ("blocker", "the run resolved ep backend 'deepep' (MOERL_EP_BACKEND) but "
                                                       "this image has no DeepEP: use the trainer image or ep_backend: "
                                                       "alltoall")


@pytest.mark.parametrize("variant", ["stock-v1", "none"])
def test_a_run_claiming_efa_deepep_needs_the_efa_variant(variant):
    env = {doctor.DEEPEP_VARIANT_ENV: variant, doctor.DEEPEP_EFA_ENV: "1"}
    check = doctor.check_deepep(Context(role="trainer", env=env, expect_efa=True))
    assert (check.status, check.detail) == ("blocker", "the run says its trainer image carries an EFA-capable DeepEP "
                                                       f"(deploy.images.deepep_efa) but this image carries {variant!r}: "
                                                       "build it with DEEPEP_VARIANT=efa-v1 or set deepep_efa: false")


@pytest.mark.parametrize("variant, status, fragment", [
    ("none", "ok", "alltoall (NCCL); no DeepEP in this image"),
    ("stock-v1", "blocker", "the image records DeepEP stock-v1 but deep_ep does not import: ModuleNotFoundError"),
    ("v2", "blocker", "MOERL_DEEPEP_VARIANT='v2'; the image must record one of efa-v1, stock-v1, none"),
])
def test_deepep_variant_the_image_records(variant, status, fragment):
    check = doctor.check_deepep(Context(role="trainer", env={doctor.DEEPEP_VARIANT_ENV: variant}, expect_efa=True))
    assert (check.status, check.detail.startswith(fragment)) == (status, True), check.detail


def test_efa_deepep_needs_nvshmem_as_aws_sets_it_its_libfabric_transport_and_gdrcopy(tmp_path):
    where = Path("/opt/venv/deep_ep")
    env = {**DEEPEP_EFA_NVSHMEM_ENV, "NVSHMEM_REMOTE_TRANSPORT": "ibgda", "LD_LIBRARY_PATH": str(tmp_path)}
    del env["NVSHMEM_NETDEVS_POLICY"]
    missing_gdrdrv = Context(role="trainer", env=env, expect_efa=True, gdrdrv=tmp_path / "gdrdrv")
    check = doctor._check_nvshmem_libfabric(missing_gdrdrv, where)
    assert (check.status, check.detail) == ("blocker", "DeepEP efa-v1 needs NVSHMEM_REMOTE_TRANSPORT='ibgda' "
                                            "(needs 'libfabric'), NVSHMEM_NETDEVS_POLICY=None (needs "
                                            "'EXTERNAL_SHARING_PCIE_SWITCH_NIC_EXCLUSIVE')")
    env.update(DEEPEP_EFA_NVSHMEM_ENV)
    check = doctor._check_nvshmem_libfabric(missing_gdrdrv, where)
    assert check.status == "blocker" and "(nvshmem_transport_libfabric.so*) is not on LD_LIBRARY_PATH" in check.detail
    (tmp_path / "nvshmem_transport_libfabric.so.3").write_bytes(b"")
    (tmp_path / "gdrdrv").write_bytes(b"")  # a regular file is not the driver's character device
    check = doctor._check_nvshmem_libfabric(missing_gdrdrv, where)
    assert (check.status, check.detail) == ("blocker", f"{tmp_path}/gdrdrv is missing: DeepEP efa-v1's NVSHMEM proxy "
                                            "needs GDRCopy. The node must load GDRCopy's gdrdrv kernel module (the EKS "
                                            "AL2023 NVIDIA AMI does not) and the container get the device (NVIDIA "
                                            "device plugin gdrcopyEnabled, or NVIDIA_GDRCOPY=enabled)")
    # Any character device stands in for /dev/gdrdrv.
    check = doctor._check_nvshmem_libfabric(Context(role="trainer", env=env, expect_efa=True, gdrdrv=Path("/dev/null")),
                                            where)
    assert check.status == "ok" and str(tmp_path / "nvshmem_transport_libfabric.so.3") in check.detail


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a plugin library")
def test_nccl_plugins_are_loaded_as_nccl_loads_them(tmp_path):
    # A library exporting the plugin struct symbols NCCL looks up, built here; and one that exports none.
    (tmp_path / "net.c").write_text("int ncclNetPlugin_v8; int ncclNetPlugin_v10;\n")
    (tmp_path / "tuner.c").write_text("int unrelated;\n")
    for name, source in (("libnccl-net-test.so", "net.c"), ("libnccl-tuner-test.so", "tuner.c")):
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / name), str(tmp_path / source)], check=True)
    env = {"NCCL_NET_PLUGIN": str(tmp_path / "libnccl-net-test.so"),
           "NCCL_TUNER_PLUGIN": str(tmp_path / "libnccl-tuner-test.so")}
    net = doctor.check_ofi_plugin(Context(role="trainer", env=env, expect_efa=True))
    tuner = doctor.check_ofi_tuner(Context(role="trainer", env=env, expect_efa=True))
    assert (net.status, net.detail) == ("ok", f"{tmp_path}/libnccl-net-test.so exports ncclNetPlugin_v10")
    assert (tuner.status, tuner.detail) == ("blocker", f"{tmp_path}/libnccl-tuner-test.so loads but exports no "
                                                       "ncclTunerPlugin_v*")


@pytest.fixture
def importable_deep_ep(tmp_path, monkeypatch):
    """An importable `deep_ep` package: the doctor's variant rules are under test here, not DeepEP (built and
    imported on the H200, images/results/h200-build-check-2026-12-01.log)."""
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    return tmp_path / "deep_ep"


@pytest.mark.parametrize("variant, efa, env, status, fragment", [
    ("stock-v1", False, {}, "ok", "alltoall, deepep intranode and internode (stock V1"),
    ("stock-v1", True, {}, "warn", "alltoall, deepep intranode (stock V1"),
    ("efa-v1", False, {"NVSHMEM_REMOTE_TRANSPORT": "none"}, "ok", "alltoall, deepep intranode (efa-v1"),
    ("efa-v1", True, {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_LIBFABRIC_PROVIDER": "efa"}, "blocker",
     "DeepEP efa-v1 needs NVSHMEM_REMOTE_TRANSPORT='none' (needs 'libfabric')"),
])
def test_deepep_backends_by_variant_and_network(importable_deep_ep, variant, efa, env, status, fragment):
    check = doctor.check_deepep(Context(role="trainer", env={doctor.DEEPEP_VARIANT_ENV: variant, **env}, expect_efa=efa))
    assert check.status == status and check.detail.startswith(fragment), check.detail
