"""`moerl doctor --role trainer|rollout|orchestrator`: can this container do its role's job on this node?

Run as the first step of the cluster validation job and as a startup check of every pod (Kubernetes ignores a
Docker HEALTHCHECK). Each check prints one line; a blocker makes the exit status 1, so a pod that cannot use its
GPUs, EFA or DeepEP stops at once with the reason instead of hanging in its first collective or falling back to
TCP without a word.

Checks, by role (the orchestrator image has no GPU, so its role checks none):
- all: the role's entry point imports, /tmp (the writable volume on a read-only root) is writable;
- trainer, rollout: NVIDIA driver and GPU count (NVML), torch's CUDA build against the driver, NCCL's version;
  with EFA expected (`--efa yes`, or `auto` and FI_PROVIDER=efa as the manifests set it): libfabric offers the
  `efa` provider (`fi_info`), the aws-ofi-nccl net plugin and its tuner load, `ulimit -l` is unlimited and
  2 MiB hugepages are reserved;
- trainer: which expert-parallel backends can load: `deep_ep` and the variant the image records
  (MOERL_DEEPEP_VARIANT), and for the EFA variant NVSHMEM's libfabric transport, its variables and /dev/gdrdrv.

Only the standard library is imported at module level: torch and deep_ep are imported inside their checks,
so the doctor reports a broken install as a blocker instead of dying on it.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping

from moe_rl_eks.core.container import (DEEPEP_EFA_ENV, DEEPEP_EFA_NVSHMEM_ENV, DEEPEP_VARIANT_ENV, DEEPEP_VARIANTS,
                                       EP_BACKEND_ENV, GDRDRV_DEVICE, ROLE_COMMANDS, ROLES, Role)

Status = Literal["ok", "warn", "blocker"]
FI_INFO_CANDIDATES = ("fi_info", "/opt/amazon/efa/bin/fi_info")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass(frozen=True)
class Context:
    """What the checks read from outside: the environment, /proc/meminfo, GDRCopy's device, and whether EFA is
    expected."""
    role: Role
    env: Mapping[str, str]
    expect_efa: bool
    meminfo: Path = MEMINFO
    gdrdrv: Path = Path(GDRDRV_DEVICE)


# --- checks every role runs ---------------------------------------------------------------------------------

def check_entry_point(ctx: Context) -> Check:
    from .cli import SUBCOMMANDS  # the same table `moerl` dispatches from
    command = ROLE_COMMANDS[ctx.role]
    module, func, _ = SUBCOMMANDS[command]
    try:
        entry = getattr(importlib.import_module(module), func)
    except Exception as exc:  # any import failure is the finding itself
        return Check("entry point", "blocker", f"`moerl {command}` ({module}.{func}) does not import: "
                     f"{type(exc).__name__}: {exc}")
    if not callable(entry):
        return Check("entry point", "blocker", f"{module}.{func} is not callable")
    return Check("entry point", "ok", f"`moerl {command}` -> {module}.{func}")


def check_scratch(ctx: Context) -> Check:
    # The root filesystem is read-only; /tmp is the pod's emptyDir and holds HOME and the triton/HF caches.
    scratch = ctx.env.get("TMPDIR", "/tmp")
    try:
        with tempfile.NamedTemporaryFile(dir=scratch):
            pass
    except OSError as exc:
        return Check("scratch", "blocker", f"{scratch} is not writable ({exc.strerror}); mount a writable "
                     "volume there (the root filesystem is read-only)")
    return Check("scratch", "ok", f"{scratch} writable")


# --- GPU roles ----------------------------------------------------------------------------------------------

class _Nvml:
    """The few NVML calls the doctor needs, through ctypes: no Python binding is needed in the image."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._call("nvmlInit_v2")

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise OSError(f"{name} returned NVML error {rc}")

    def driver_version(self) -> str:
        buf = ctypes.create_string_buffer(96)
        self._call("nvmlSystemGetDriverVersion", buf, ctypes.c_uint(len(buf)))
        return buf.value.decode()

    def cuda_driver_version(self) -> tuple[int, int]:
        value = ctypes.c_int()
        self._call("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(value))
        return value.value // 1000, value.value % 1000 // 10

    def device_count(self) -> int:
        count = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        return count.value


def check_gpus(ctx: Context) -> Check:
    try:
        nvml = _Nvml()
        driver, cuda, count = nvml.driver_version(), nvml.cuda_driver_version(), nvml.device_count()
    except OSError as exc:
        return Check("gpu", "blocker", f"no NVIDIA driver visible ({exc}); the pod needs nvidia.com/gpu and the "
                     "NVIDIA container runtime")
    if count == 0:
        return Check("gpu", "blocker", f"driver {driver} sees no GPU")
    detail = f"{count} GPU(s), driver {driver} (CUDA {cuda[0]}.{cuda[1]})"
    try:
        import torch
    except Exception as exc:
        return Check("gpu", "blocker", f"{detail}; torch does not import: {exc}")
    if torch.version.cuda is None:
        return Check("gpu", "blocker", f"{detail}; torch {torch.__version__} is a CPU build")
    built = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
    if built > cuda:
        return Check("gpu", "blocker", f"{detail}; torch {torch.__version__} needs CUDA {torch.version.cuda}, newer "
                     f"than the driver supports: use a node AMI with a newer driver")
    return Check("gpu", "ok", f"{detail}; torch {torch.__version__} (CUDA {torch.version.cuda})")


def check_nccl(ctx: Context) -> Check:
    try:
        import torch
    except Exception as exc:
        return Check("nccl", "blocker", f"torch does not import: {exc}")
    if torch.version.cuda is None:
        return Check("nccl", "blocker", f"torch {torch.__version__} is a CPU build: no NCCL")
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:
        return Check("nccl", "blocker", f"torch's NCCL does not load: {type(exc).__name__}: {exc}")
    return Check("nccl", "ok", "NCCL " + ".".join(str(v) for v in version))


def _load_plugin(library: str, symbol_prefix: str, versions: range) -> tuple[str | None, str]:
    """dlopen `library` as NCCL would (the dynamic linker's search path) and find its newest exported
    `<prefix>_v<N>` struct. Returns (symbol or None, detail)."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return None, f"{library} does not load: {exc}"
    for version in reversed(versions):
        name = f"{symbol_prefix}_v{version}"
        try:
            getattr(lib, name)
        except AttributeError:
            continue
        return name, f"{library} exports {name}"
    return None, f"{library} loads but exports no {symbol_prefix}_v*"


def check_ofi_plugin(ctx: Context) -> Check:
    # NCCL_NET_PLUGIN=ofi makes NCCL dlopen libnccl-net-ofi.so; a plugin that fails to load sends NCCL to
    # sockets silently, so load it the same way here.
    plugin = ctx.env.get("NCCL_NET_PLUGIN", "ofi")
    library = plugin if plugin.endswith(".so") else f"libnccl-net-{plugin}.so"
    symbol, detail = _load_plugin(library, "ncclNetPlugin", range(2, 20))
    return Check("nccl net plugin", "ok" if symbol else "blocker", detail)


def check_ofi_tuner(ctx: Context) -> Check:
    tuner = ctx.env.get("NCCL_TUNER_PLUGIN", "ofi")
    library = tuner if tuner.endswith(".so") else f"libnccl-tuner-{tuner}.so"
    symbol, detail = _load_plugin(library, "ncclTunerPlugin", range(1, 20))
    return Check("nccl tuner", "ok" if symbol else "blocker", detail)


def check_efa_provider(ctx: Context) -> Check:
    fi_info = next((path for path in map(shutil.which, FI_INFO_CANDIDATES) if path), None)
    if fi_info is None:
        return Check("libfabric efa", "blocker", "fi_info not found: libfabric (EFA installer) is not in the image")
    try:
        result = subprocess.run([fi_info, "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return Check("libfabric efa", "blocker", f"{fi_info} -p efa did not answer in 30 s")
    if result.returncode != 0 or "provider: efa" not in result.stdout:
        reason = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return Check("libfabric efa", "blocker", f"libfabric offers no efa provider ({reason[0]}); the pod needs "
                     "vpc.amazonaws.com/efa devices")
    devices = sorted({line.split(":", 1)[1].strip() for line in result.stdout.splitlines()
                      if line.strip().startswith("domain:")})
    return Check("libfabric efa", "ok", f"efa provider on {len(devices)} domain(s)")


def check_memlock(ctx: Context) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("ulimit -l", "ok", "unlimited")
    shown = f"{soft // 1024} KiB"
    if ctx.expect_efa:
        # EFA registers (pins) communication buffers; a capped limit fails fi_mr_reg with -12 (ENOMEM). A
        # non-root container gets no effective IPC_LOCK, so the limit must come from the runtime (containerd
        # LimitMEMLOCK=infinity on the node).
        return Check("ulimit -l", "blocker", f"{shown}; EFA memory registration needs unlimited locked memory "
                     "(raise LimitMEMLOCK for containerd on the node)")
    return Check("ulimit -l", "warn", f"{shown} (fine without EFA)")


def read_hugepages(meminfo: Path) -> tuple[int, int, int]:
    """(total pages, free pages, page size in KiB) from a /proc/meminfo text."""
    fields = {}
    for line in meminfo.read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.split()[0] if value.split() else "0"
    return int(fields.get("HugePages_Total", 0)), int(fields.get("HugePages_Free", 0)), int(fields.get("Hugepagesize", 0))


def check_hugepages(ctx: Context) -> Check:
    try:
        total, free, size_kib = read_hugepages(ctx.meminfo)
    except OSError as exc:
        return Check("hugepages", "blocker" if ctx.expect_efa else "warn", f"cannot read {ctx.meminfo}: {exc}")
    detail = f"{total} x {size_kib // 1024} MiB reserved, {free} free"
    if total == 0 and ctx.expect_efa:
        return Check("hugepages", "blocker", f"{detail}; libfabric's EFA buffers need hugepages (node pool "
                     "hugepages_2mi and the pod's hugepages-2Mi request)")
    return Check("hugepages", "ok" if total else "warn", detail)


# --- trainer: expert-parallel backends ------------------------------------------------------------------------

def check_deepep(ctx: Context) -> Check:
    variant = ctx.env.get(DEEPEP_VARIANT_ENV, "")
    if variant not in DEEPEP_VARIANTS:
        return Check("ep backends", "blocker", f"{DEEPEP_VARIANT_ENV}={variant!r}; the image must record one of "
                     f"{', '.join(DEEPEP_VARIANTS)}")
    if ctx.env.get(DEEPEP_EFA_ENV) == "1" and variant != "efa-v1":
        return Check("ep backends", "blocker", f"the run says its trainer image carries an EFA-capable DeepEP "
                     f"(deploy.images.deepep_efa) but this image carries {variant!r}: build it with "
                     "DEEPEP_VARIANT=efa-v1 or set deepep_efa: false")
    if variant == "none":
        if ctx.env.get(EP_BACKEND_ENV) == "deepep":
            return Check("ep backends", "blocker", f"the run resolved ep backend 'deepep' ({EP_BACKEND_ENV}) but this "
                         "image has no DeepEP: use the trainer image or ep_backend: alltoall")
        return Check("ep backends", "ok", "alltoall (NCCL); no DeepEP in this image")
    try:
        import deep_ep
    except Exception as exc:
        return Check("ep backends", "blocker", f"the image records DeepEP {variant} but deep_ep does not import: "
                     f"{type(exc).__name__}: {exc}")
    where = Path(deep_ep.__file__).parent
    if variant == "stock-v1":
        if ctx.expect_efa:
            return Check("ep backends", "warn", f"alltoall, deepep intranode (stock V1 at {where}); deepep internode "
                         "needs InfiniBand GPU-initiated RDMA, which EFA lacks: multi-node runs must use alltoall")
        return Check("ep backends", "ok", f"alltoall, deepep intranode and internode (stock V1 at {where})")
    if not ctx.expect_efa:
        # Without EFA only the NVLink kernels run, and the manifests set no remote transport.
        return Check("ep backends", "ok", f"alltoall, deepep intranode (efa-v1 at {where}; no EFA expected here)")
    return _check_nvshmem_libfabric(ctx, where)


def _check_nvshmem_libfabric(ctx: Context, where: Path) -> Check:
    # The EFA variant reaches other nodes through NVSHMEM's host proxy over libfabric: NVSHMEM must be set up as
    # AWS's reference sets it, its transport library must be on the loader path, and GDRCopy's device must be in
    # the container.
    wrong = [f"{k}={ctx.env.get(k)!r} (needs {v!r})" for k, v in DEEPEP_EFA_NVSHMEM_ENV.items() if ctx.env.get(k) != v]
    if wrong:
        return Check("ep backends", "blocker", "DeepEP efa-v1 needs " + ", ".join(wrong))
    transport = _find_library("nvshmem_transport_libfabric.so", ctx.env)
    if transport is None:
        return Check("ep backends", "blocker", "NVSHMEM's libfabric transport (nvshmem_transport_libfabric.so*) is "
                     "not on LD_LIBRARY_PATH")
    if not ctx.gdrdrv.is_char_device():
        return Check("ep backends", "blocker", f"{ctx.gdrdrv} is missing: DeepEP efa-v1's NVSHMEM proxy needs GDRCopy. "
                     "The node must load GDRCopy's gdrdrv kernel module (the EKS AL2023 NVIDIA AMI does not) and the "
                     "container get the device (NVIDIA device plugin gdrcopyEnabled, or NVIDIA_GDRCOPY=enabled)")
    return Check("ep backends", "ok", f"alltoall, deepep intranode and internode over EFA (efa-v1 at {where}; "
                 f"NVSHMEM transport {transport})")


def _find_library(prefix: str, env: Mapping[str, str]) -> Path | None:
    for folder in filter(None, env.get("LD_LIBRARY_PATH", "").split(":")):
        matches = sorted(Path(folder).glob(prefix + "*"))
        if matches:
            return matches[0]
    return None


CheckFn = Callable[[Context], Check]
_COMMON: tuple[CheckFn, ...] = (check_entry_point, check_scratch)
_GPU: tuple[CheckFn, ...] = (check_gpus, check_nccl, check_memlock, check_hugepages)
_EFA: tuple[CheckFn, ...] = (check_efa_provider, check_ofi_plugin, check_ofi_tuner)


def checks_for(role: Role, expect_efa: bool) -> tuple[CheckFn, ...]:
    if role == "orchestrator":
        return _COMMON
    return _COMMON + _GPU + (_EFA if expect_efa else ()) + ((check_deepep,) if role == "trainer" else ())


def run_checks(ctx: Context) -> list[Check]:
    return [check(ctx) for check in checks_for(ctx.role, ctx.expect_efa)]


def format_checks(role: Role, results: list[Check]) -> str:
    width = max(len(c.name) for c in results)
    lines = [f"{c.status.upper():8} {c.name:{width}}  {c.detail}" for c in results]
    blockers = sum(c.status == "blocker" for c in results)
    lines.append(f"doctor --role {role}: " + (f"{blockers} blocker(s)" if blockers else "ready"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", required=True, choices=ROLES, help="the role this container runs")
    parser.add_argument("--efa", nargs="?", const="yes", default="auto", choices=("auto", "yes", "no"),
                        help="whether EFA must work here; bare --efa means yes (default auto: when FI_PROVIDER=efa, "
                             "as the EFA pods' manifests set it)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    expect_efa = args.efa == "yes" or (args.efa == "auto" and env.get("FI_PROVIDER") == "efa")
    results = run_checks(Context(role=args.role, env=env, expect_efa=expect_efa and args.role != "orchestrator"))
    if args.json:
        print(json.dumps({"role": args.role, "checks": [asdict(c) for c in results]}, indent=2))
    else:
        print(format_checks(args.role, results))
    sys.stdout.flush()
    return 1 if any(c.status == "blocker" for c in results) else 0
