"""What a cluster run needs beyond the model and its parallelism: the `deploy:` section of a run file.

k8s/ reads it to write the manifests; the ECR repositories themselves come from the stack outputs, so a run
only names the image version it was built as.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .schema import Validated, fail

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# Tags that name "whatever was pushed last": a restart could pull a different image on every node.
_FLOATING_TAGS = frozenset({"latest", "main", "master", "stable", "edge", "nightly"})


def image_version_problem(version: str) -> str | None:
    """Why `version` is not an immutable image tag or digest, or None when it is."""
    if _DIGEST.fullmatch(version):
        return None
    if not _TAG.fullmatch(version):
        return "expected a digest (sha256:<64 hex>) or an image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"
    if version.lower() in _FLOATING_TAGS:
        return f"floating tags ({', '.join(sorted(_FLOATING_TAGS))}) are refused; use a release tag or a digest"
    return None


def image_reference(repository_uri: str, version: str) -> str:
    """`repo@sha256:...` for a digest, `repo:tag` for a tag."""
    return f"{repository_uri}@{version}" if _DIGEST.fullmatch(version) else f"{repository_uri}:{version}"


IMAGE_ROLES = ("trainer", "rollout", "orchestrator")


@dataclass(frozen=True)
class ImagesConfig(Validated):
    # Versions in the stack's ECR repositories (tags are immutable there). The trainer image also runs the cluster
    # validation jobs (it holds torch, NCCL and aws-ofi-nccl); the orchestrator's is small and CPU-only.
    trainer: str
    rollout: str
    orchestrator: str
    # The trainer image carries a DeepEP that runs between nodes over EFA (AWS's patched V1 with NVSHMEM's
    # libfabric transport, or V2 over NCCL GIN) and the validation job has shown it. Stock DeepEP needs
    # InfiniBand GPU-initiated RDMA, which EFA lacks: without this, DeepEP runs only inside a node.
    deepep_efa: bool = False

    def validate(self) -> None:
        for name in IMAGE_ROLES:
            problem = image_version_problem(getattr(self, name))
            if problem:
                fail(name, getattr(self, name), problem)


@dataclass(frozen=True)
class DeployConfig(Validated):
    images: ImagesConfig
    # JobSet restarts the whole trainer gang this many times (each restart resumes from the last checkpoint).
    trainer_max_restarts: int = 3
    trainer_shm_gib: int = 64  # /dev/shm of each trainer pod (memory-backed; counts against its memory)
    rollout_shm_gib: int = 16  # /dev/shm of each rollout server
    # Seconds a rollout server keeps serving in-flight requests after it is told to stop (preStop drain).
    rollout_drain_seconds: int = 60

    def validate(self) -> None:
        if not 0 <= self.trainer_max_restarts <= 100:
            fail("trainer_max_restarts", self.trainer_max_restarts, "must be between 0 and 100")
        for name in ("trainer_shm_gib", "rollout_shm_gib"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if not 0 <= self.rollout_drain_seconds <= 3600:
            fail("rollout_drain_seconds", self.rollout_drain_seconds, "must be between 0 and 3600")
