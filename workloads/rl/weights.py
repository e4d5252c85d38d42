"""Weight store: where trainers publish each weight version (Hugging Face format: safetensors + config.json, plus
our manifest) and rollout servers load it. Publication is atomic, so a reader never sees a half-written version:

- directory store (`local`, and `fs` on a shared filesystem such as FSx for Lustre): files are written into a
  staging directory beside the versions, fsynced, and the directory is renamed into place (rename is atomic
  within one filesystem); the LATEST pointer is replaced the same way.
- S3: shards are uploaded first, `manifest.json` last (one PUT is atomic), then LATEST. A version without its
  manifest does not exist for readers; readers verify every file's size and SHA-256 against the manifest.

A version, once published, is immutable: publishing it again (a resumed trainer re-publishing the version its
checkpoint holds) is a no-op.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from moe_rl_eks.core.rl_config import WeightStoreConfig

MANIFEST = "manifest.json"
LATEST = "LATEST"


class IncompleteVersion(RuntimeError):
    """A version is missing, or its files do not match its manifest."""


def version_name(version: int) -> str:
    return f"v{version:08d}"


def build_manifest(version: int, directory: Path) -> dict:
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    if not files:
        raise IncompleteVersion(f"nothing to publish in {directory}")
    return {"version": version, "format": "huggingface-safetensors", "files": files}


def verify(directory: Path, manifest: dict) -> None:
    for name, facts in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != facts["bytes"] or _sha256(path) != facts["sha256"]:
            raise IncompleteVersion(f"{path} does not match version {manifest['version']}'s manifest")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class WeightStore(ABC):
    @abstractmethod
    def publish(self, version: int, source: Path) -> None:
        """Make the files of `source` (a Hugging Face checkpoint directory) version `version`, atomically."""

    @abstractmethod
    def latest(self) -> int | None:
        """The newest completely published version, or None."""

    @abstractmethod
    def fetch(self, version: int, cache: Path) -> Path:
        """A local directory holding version `version`, verified against its manifest (may download to `cache`)."""


class DirectoryStore(WeightStore):
    def __init__(self, root: str | Path, keep_versions: int = 3) -> None:
        self.root, self.keep_versions = Path(root), keep_versions
        self.root.mkdir(parents=True, exist_ok=True)

    def publish(self, version: int, source: Path) -> None:
        target = self.root / version_name(version)
        if (target / MANIFEST).is_file():
            return
        staging = self.root / f".staging-{version_name(version)}-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(source, staging)
            manifest = build_manifest(version, staging)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
            for path in staging.iterdir():
                fsync(path)
            os.rename(staging, target)
            fsync(self.root)
            self._write_latest(version)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._prune()

    def _write_latest(self, version: int) -> None:
        tmp = self.root / f".{LATEST}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(str(version))
        fsync(tmp)
        os.replace(tmp, self.root / LATEST)

    def latest(self) -> int | None:
        try:
            return int((self.root / LATEST).read_text())
        except FileNotFoundError:
            return None

    def fetch(self, version: int, cache: Path) -> Path:
        directory = self.root / version_name(version)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except FileNotFoundError:
            raise IncompleteVersion(f"version {version} is not published in {self.root}") from None
        verify(directory, manifest)
        return directory

    def _prune(self) -> None:
        versions = sorted(p for p in self.root.glob("v*") if p.is_dir())
        for old in versions[:-self.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)


def fsync(path: Path) -> None:
    """Flush a file or directory entry to disk (before a rename publishes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Store(WeightStore):
    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None, keep_versions: int = 3) -> None:
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=endpoint_url)
        self.bucket, self.prefix, self.keep_versions = bucket, prefix.strip("/"), keep_versions

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def _manifest(self, version: int) -> dict | None:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._key(version_name(version), MANIFEST))["Body"]
        except self.s3.exceptions.NoSuchKey:
            return None
        return json.loads(body.read())

    def publish(self, version: int, source: Path) -> None:
        if self._manifest(version) is not None:
            return
        manifest = build_manifest(version, source)
        for name in manifest["files"]:
            self.s3.upload_file(str(source / name), self.bucket, self._key(version_name(version), name))
        self.s3.put_object(Bucket=self.bucket, Key=self._key(version_name(version), MANIFEST),
                           Body=json.dumps(manifest, indent=1).encode())
        self.s3.put_object(Bucket=self.bucket, Key=self._key(LATEST), Body=str(version).encode())
        self._prune(version)

    def latest(self) -> int | None:
        try:
            return int(self.s3.get_object(Bucket=self.bucket, Key=self._key(LATEST))["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def fetch(self, version: int, cache: Path) -> Path:
        manifest = self._manifest(version)
        if manifest is None:
            raise IncompleteVersion(f"version {version} is not published in s3://{self.bucket}/{self.prefix}")
        directory = Path(cache) / version_name(version)
        directory.mkdir(parents=True, exist_ok=True)
        for name in manifest["files"]:
            self.s3.download_file(self.bucket, self._key(version_name(version), name), str(directory / name))
        verify(directory, manifest)
        return directory

    def _prune(self, newest: int) -> None:
        oldest_kept = newest - self.keep_versions + 1
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + "/v"):
            stale = [{"Key": o["Key"]} for o in page.get("Contents", [])
                     if int(o["Key"][len(self.prefix) + 2:].split("/")[0]) < oldest_kept]
            if stale:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": stale})


def open_store(cfg: WeightStoreConfig, default_path: Path) -> WeightStore:
    if cfg.kind == "s3":
        return S3Store(cfg.bucket, cfg.prefix, cfg.endpoint_url, cfg.keep_versions)
    return DirectoryStore(cfg.path or default_path, cfg.keep_versions)
