"""Weight store: where trainers publish each weight version (Hugging Face format: safetensors + config.json, plus
our manifest) and rollout servers load it.

A version is named by `VersionRef(lineage, version)`: every trainer start from a checkpoint begins a new lineage
whose numbers may repeat a dead lineage's, so the store keeps them apart (`l00001-v00000010`). LATEST moves
forward only (a newer lineage, or the same lineage and a higher version); publishing an existing version is a
no-op; publishing one older than LATEST is refused (a trainer of a dead lineage must not publish), also against a
publisher in another process: the directory store commits under an flock, S3 moves LATEST by a conditional write.

No copies inside the store: a writer stages a version's files on the store's own filesystem (`stage`) and the
commit renames the whole directory into place (directory store; atomic within one filesystem), after fsync of
every file, the manifest and the directory. S3 has no rename: a version's objects are uploaded (multipart, in
parallel, from the writer's memory, with S3's additional CRC32 checksums, which S3 verifies on receipt), its
manifest last; a version without its manifest does not exist for readers.

Integrity is computed once: the writer records each file's size and each tensor's XXH3 as it writes
(workloads/model/safetensors_io.py); `fetch` checks presence and sizes (a stat, no read), and the loader
(`load_hf`) checks every tensor's checksum while it reads the bytes anyway. Never a separate hashing pass.

Expert-parallel trainers stage one version together: each rank (`part`) writes its own experts' files into the
same staging area and leaves a part record (written, skipped or failed); part 0 waits for every record, and
commits only if every part was written, else abandons the version (all or none).
"""
from __future__ import annotations

import fcntl
import io
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from moe_rl_eks.core.rl_config import WeightStoreConfig

from ..model.checkpoint import MANIFEST
from ..model.safetensors_io import FileLayout, IntegrityError, file_facts, seal, write_file
from .protocol import VersionRef

LATEST = "LATEST"
NAME = re.compile(r"^l(\d{5})-v(\d{9})$")
PART_WAIT_S = 900.0  # how long part 0 waits for the other ranks' files of a version


class IncompleteVersion(IntegrityError):
    """A version is missing, or its files do not match its manifest."""


class StaleVersion(ValueError):
    """A publication older than LATEST (a dead lineage's trainer, or a version that already went by)."""


class AbandonedVersion(RuntimeError):
    """An expert-parallel publication some rank skipped or failed: nothing was published."""


def version_name(ref: VersionRef) -> str:
    return f"l{ref.lineage:05d}-v{ref.version:09d}"


def parse_name(name: str) -> VersionRef | None:
    match = NAME.match(name)
    return VersionRef(int(match.group(1)), int(match.group(2))) if match else None


@dataclass
class Staging:
    """Where a writer puts a version's files (`directory`), and the manifest facts of those it already
    checksummed while writing (`facts`; any other file is checksummed at commit, which reads it)."""

    ref: VersionRef
    directory: Path
    part: int
    parts: int
    store: "WeightStore"
    facts: dict[str, dict] = field(default_factory=dict)

    def put(self, image: memoryview, layout: FileLayout) -> None:
        """Add one planned safetensors file from its image in memory (a file in the staging directory, or
        straight into the store's objects: S3 uploads from memory, no local copy) and record its facts.
        Several files may be put from several threads at once."""
        self.facts[layout.name] = self.store._put(self, image, layout)

    def collect_parts(self, timeout_s: float = PART_WAIT_S) -> dict[str, dict]:
        """Part 0: wait for every other part's record; their files' facts (raises AbandonedVersion if a part
        was skipped or failed, TimeoutError if one never came)."""
        return self.store._collect_parts(self, timeout_s)


class WeightStore(ABC):
    keep_versions: int

    def publish(self, version: int, source: Path, *, lineage: int = 0) -> None:
        """Make the files of `source` (a Hugging Face checkpoint directory) version (lineage, version). The files
        are hard-linked into the staging area when they share its filesystem (no copy), else copied, and
        checksummed at the commit (one read, from the page cache when they were just written). The trainer's
        path, publisher.Publisher, stages through `stage` and checksums while writing instead."""
        with self.stage(VersionRef(lineage, version)) as staging:
            if staging is None:
                return
            for path in Path(source).iterdir():
                if path.is_file():
                    _link_or_copy(path, staging.directory / path.name)

    @contextmanager
    def stage(self, ref: VersionRef, *, part: int = 0, parts: int = 1) -> Iterator[Staging | None]:
        """Stage version `ref`: write its files into the yielded Staging's directory; leaving the block commits
        (part 0) or records this part (others). None is yielded when `ref` is already published (a no-op).
        An exception inside the block publishes nothing and removes what was staged."""
        if not 0 <= part < parts:
            raise ValueError(f"part: {part} is not in [0, {parts})")
        if self._exists(ref):
            yield None
            return
        latest = self.latest()
        if latest is not None and ref < latest:
            raise StaleVersion(f"version {ref} is older than LATEST {latest}: a dead lineage, or a version that "
                               "already went by, cannot be published")
        staging = self._open_staging(ref, part, parts)
        try:
            yield staging
        except BaseException:
            self._discard(staging)
            if part > 0:
                self._record_part(ref, part, "failed", {})
            raise
        for path in sorted(staging.directory.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name not in staging.facts:
                staging.facts[path.name] = file_facts(path)
        if part > 0:
            try:
                self._ship(staging)
            except BaseException:
                self._record_part(ref, part, "failed", {})
                raise
            self._record_part(ref, part, "written", staging.facts)
            return
        manifest = {"lineage": ref.lineage, "version": ref.version, "format": "huggingface-safetensors",
                    "files": staging.facts}
        try:
            self._commit(staging, manifest)
        except BaseException:
            self._discard(staging)
            raise
        self._prune()

    def skip(self, ref: VersionRef, part: int) -> None:
        """Tell part 0 that this rank will not write version `ref` (a newer one superseded it)."""
        self._record_part(ref, part, "skipped", {})

    @abstractmethod
    def latest(self) -> VersionRef | None:
        """The newest completely published version, or None."""

    def fetch(self, ref: VersionRef | int, cache: Path) -> Path:
        """A local directory holding version `ref` with its manifest (a plain number means that version of
        LATEST's lineage). Presence and sizes are checked here; every tensor's checksum as load_hf reads it."""
        if isinstance(ref, int):
            latest = self.latest()
            ref = VersionRef(latest.lineage if latest is not None else 0, ref)
        directory = self._fetch(ref, Path(cache))
        manifest = json.loads((directory / MANIFEST).read_text())
        for name, facts in manifest["files"].items():
            path = directory / name
            size = path.stat().st_size if path.is_file() else None
            if size != facts["bytes"]:
                raise IncompleteVersion(f"{path}: {'missing' if size is None else f'{size} bytes'}; version "
                                        f"{ref}'s manifest says {facts['bytes']} bytes")
        return directory

    # ---- what each store implements ------------------------------------------------------------------------
    @abstractmethod
    def _exists(self, ref: VersionRef) -> bool: ...

    @abstractmethod
    def _open_staging(self, ref: VersionRef, part: int, parts: int) -> Staging: ...

    def _put(self, staging: Staging, image: memoryview, layout: FileLayout) -> dict:
        return write_file(staging.directory / layout.name, image, layout)

    def _ship(self, staging: Staging) -> None:
        """Parts > 0: make this part's staged files visible to part 0 (nothing to do on a shared filesystem)."""

    @abstractmethod
    def _record_part(self, ref: VersionRef, part: int, status: str, files: dict) -> None:
        """Parts > 0: leave this part's record (written, skipped or failed; its files' facts) for part 0."""

    @abstractmethod
    def _part_record(self, ref: VersionRef, part: int) -> dict | None: ...

    @abstractmethod
    def _commit(self, staging: Staging, manifest: dict) -> None: ...

    @abstractmethod
    def _discard(self, staging: Staging) -> None: ...

    @abstractmethod
    def _fetch(self, ref: VersionRef, cache: Path) -> Path: ...

    @abstractmethod
    def _versions(self) -> list[VersionRef]: ...

    @abstractmethod
    def _delete(self, ref: VersionRef) -> None: ...

    def _collect_parts(self, staging: Staging, timeout_s: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, staging.parts))
        facts: dict[str, dict] = {}
        while pending:
            for part in sorted(pending):
                record = self._part_record(staging.ref, part)
                if record is None:
                    continue
                if record["status"] != "written":
                    raise AbandonedVersion(f"version {staging.ref}: rank {part} {record['status']} its part")
                facts.update(record["files"])
                pending.discard(part)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"version {staging.ref}: no part from ranks {sorted(pending)} "
                                   f"after {timeout_s:.0f} s")
            if pending:
                time.sleep(0.05)
        return facts

    def _prune(self) -> None:
        """Keep the newest `keep_versions` of LATEST's lineage; older lineages are dead: delete theirs."""
        latest = self.latest()
        if latest is None:
            return
        mine = sorted(r for r in self._versions() if r.lineage == latest.lineage and r <= latest)
        doomed = [r for r in self._versions() if r.lineage < latest.lineage] + mine[:-self.keep_versions]
        for ref in doomed:
            self._delete(ref)
        self._clear_leftovers(latest)

    @abstractmethod
    def _clear_leftovers(self, latest: VersionRef) -> None:
        """Remove what crashed or abandoned publications of versions up to `latest` left behind."""


def latest_ref(text: str, where: str) -> VersionRef:
    try:
        facts = json.loads(text)
        return VersionRef(int(facts["lineage"]), int(facts["version"]))
    except (ValueError, TypeError, KeyError):
        raise IncompleteVersion(f"{where}: {text[:40]!r} is not a LATEST pointer; expected "
                                '{"lineage": int, "version": int} (a store written before lineages: publish into '
                                "a new path)") from None


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem (or one without hard links): a kernel-side copy
        shutil.copyfile(source, target)


def fsync(path: Path) -> None:
    """Flush a file or directory entry to disk (before a rename publishes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(text)
    fsync(tmp)
    os.replace(tmp, path)


class DirectoryStore(WeightStore):
    """`local`, and `fs` on a shared filesystem (FSx for Lustre): rename is atomic within it. Commits hold an
    flock on `<root>/.lock`, so the LATEST check, the rename and the LATEST update are one step even against a
    publisher in another process or on another node (a dead lineage's trainer that is still running)."""

    def __init__(self, root: str | Path, keep_versions: int = 3) -> None:
        self.root, self.keep_versions = Path(root), keep_versions
        self.root.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def latest(self) -> VersionRef | None:
        try:
            text = (self.root / LATEST).read_text()
        except FileNotFoundError:
            return None
        return latest_ref(text, str(self.root / LATEST))

    def _exists(self, ref: VersionRef) -> bool:
        return (self.root / version_name(ref) / MANIFEST).is_file()

    def _staging_dir(self, ref: VersionRef) -> Path:
        return self.root / f".staging-{version_name(ref)}"

    def _open_staging(self, ref: VersionRef, part: int, parts: int) -> Staging:
        # One process writes alone into a fresh directory. Expert-parallel ranks meet in one named after the
        # version: part 0 writes at its top, each other part in a folder of its own, moved up at the commit.
        if parts == 1:
            directory = self.root / f".staging-{version_name(ref)}-{uuid.uuid4().hex[:8]}"
            directory.mkdir()
        else:
            directory = self._staging_dir(ref)
            directory.mkdir(exist_ok=True)
            if part > 0:
                directory = directory / f".files-{part:05d}"
                directory.mkdir(exist_ok=True)
        return Staging(ref, directory, part, parts, self)

    def _part_path(self, ref: VersionRef, part: int) -> Path:
        return self._staging_dir(ref) / f".part-{part:05d}.json"

    def _record_part(self, ref: VersionRef, part: int, status: str, files: dict) -> None:
        self._staging_dir(ref).mkdir(exist_ok=True)
        _write_atomic(self._part_path(ref, part), json.dumps({"status": status, "files": files}))

    def _part_record(self, ref: VersionRef, part: int) -> dict | None:
        try:
            return json.loads(self._part_path(ref, part).read_text())
        except FileNotFoundError:
            return None

    def _commit(self, staging: Staging, manifest: dict) -> None:
        directory = staging.directory
        for folder in directory.glob(".files-*"):
            for path in folder.iterdir():
                os.rename(path, directory / path.name)
            folder.rmdir()
        for path in directory.glob(".part-*.json"):
            path.unlink()
        _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
        for path in directory.iterdir():
            fsync(path)
        fsync(directory)
        with self._locked():
            if self._exists(staging.ref):  # another publisher committed it meanwhile: ours is a no-op
                shutil.rmtree(directory, ignore_errors=True)
                return
            latest = self.latest()
            if latest is not None and staging.ref < latest:
                raise StaleVersion(f"version {staging.ref} is older than LATEST {latest}")
            os.rename(directory, self.root / version_name(staging.ref))
            fsync(self.root)
            _write_atomic(self.root / LATEST, json.dumps({"lineage": staging.ref.lineage,
                                                          "version": staging.ref.version}))
            fsync(self.root)

    def _discard(self, staging: Staging) -> None:
        if staging.part == 0:  # other parts' files go with it: the version is abandoned
            shutil.rmtree(staging.directory, ignore_errors=True)

    def _fetch(self, ref: VersionRef, cache: Path) -> Path:
        directory = self.root / version_name(ref)
        if not (directory / MANIFEST).is_file():
            raise IncompleteVersion(f"version {ref} is not published in {self.root}")
        return directory

    def _versions(self) -> list[VersionRef]:
        return [r for r in (parse_name(p.name) for p in self.root.iterdir()) if r is not None]

    def _clear_leftovers(self, latest: VersionRef) -> None:
        for path in self.root.glob(".staging-*"):
            ref = parse_name(path.name.split("-", 1)[1][:len("l00000-v000000000")])
            if ref is not None and ref <= latest:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(".deleting-*"):
            shutil.rmtree(path, ignore_errors=True)

    def _delete(self, ref: VersionRef) -> None:
        # Renamed out of the namespace first, so a reader sees the version whole or not at all.
        doomed = self.root / f".deleting-{version_name(ref)}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.root / version_name(ref), doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)


class S3Store(WeightStore):
    """Objects under `s3://bucket/prefix/<version name>/`, the manifest last, then LATEST. Uploads and downloads
    are multipart and parallel (s3transfer's TransferConfig: `chunk_mib` parts, `concurrency` threads per file,
    files in parallel); every upload carries a CRC32 additional checksum that S3 verifies."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None, keep_versions: int = 3, *,
                 chunk_mib: int = 64, concurrency: int = 16) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.s3 = boto3.client("s3", endpoint_url=endpoint_url,
                               config=Config(max_pool_connections=4 * concurrency,
                                             request_checksum_calculation="when_supported",
                                             response_checksum_validation="when_supported"))
        self.bucket, self.prefix, self.keep_versions = bucket, prefix.strip("/"), keep_versions
        self.transfer = TransferConfig(multipart_threshold=chunk_mib << 20, multipart_chunksize=chunk_mib << 20,
                                       max_concurrency=concurrency, use_threads=True)
        self.files_in_parallel = 4

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def _get_json(self, key: str) -> dict | None:
        try:
            return json.loads(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def _put_json(self, key: str, value: dict) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=json.dumps(value, indent=1).encode(),
                           ChecksumAlgorithm="CRC32")

    def latest(self) -> VersionRef | None:
        try:
            text = self.s3.get_object(Bucket=self.bucket, Key=self._key(LATEST))["Body"].read().decode()
        except self.s3.exceptions.NoSuchKey:
            return None
        return latest_ref(text, f"s3://{self.bucket}/{self._key(LATEST)}")

    def _exists(self, ref: VersionRef) -> bool:
        return self._get_json(self._key(version_name(ref), MANIFEST)) is not None

    def _open_staging(self, ref: VersionRef, part: int, parts: int) -> Staging:
        # Safetensors images come through put(), uploaded from memory; small files (config, index, tokenizer) are
        # written to local scratch and uploaded at the end, straight to their final keys.
        return Staging(ref, Path(tempfile.mkdtemp(prefix=f"moerl-{version_name(ref)}-")), part, parts, self)

    def _upload(self, staging: Staging) -> None:
        paths = [p for p in staging.directory.iterdir() if p.is_file()]

        def one(path: Path) -> None:
            self.s3.upload_file(str(path), self.bucket, self._key(version_name(staging.ref), path.name),
                                ExtraArgs={"ChecksumAlgorithm": "CRC32"}, Config=self.transfer)

        with ThreadPoolExecutor(self.files_in_parallel) as pool:
            list(pool.map(one, paths))

    def _put(self, staging: Staging, image: memoryview, layout: FileLayout) -> dict:
        facts = seal(image, layout)
        self.s3.upload_fileobj(MemoryFile(image), self.bucket, self._key(version_name(staging.ref), layout.name),
                               ExtraArgs={"ChecksumAlgorithm": "CRC32"}, Config=self.transfer)
        return facts

    def _part_key(self, ref: VersionRef, part: int) -> str:
        return self._key(".parts", version_name(ref), f"part-{part:05d}.json")

    def _ship(self, staging: Staging) -> None:
        try:
            self._upload(staging)
        finally:
            shutil.rmtree(staging.directory, ignore_errors=True)

    def _record_part(self, ref: VersionRef, part: int, status: str, files: dict) -> None:
        self._put_json(self._part_key(ref, part), {"status": status, "files": files})

    def _part_record(self, ref: VersionRef, part: int) -> dict | None:
        return self._get_json(self._part_key(ref, part))

    def _commit(self, staging: Staging, manifest: dict) -> None:
        self._ship(staging)
        latest = self.latest()
        if latest is not None and staging.ref < latest:
            raise StaleVersion(f"version {staging.ref} is older than LATEST {latest}")
        self._put_json(self._key(version_name(staging.ref), MANIFEST), manifest)
        self._move_latest(staging.ref)
        self._delete_keys(self._key(".parts", version_name(staging.ref)) + "/")

    def _move_latest(self, ref: VersionRef) -> None:
        """LATEST := ref by compare-and-swap (S3 conditional writes on its ETag), so a publisher that read an
        older LATEST never overwrites a newer one another publisher (a new lineage's trainer) wrote meanwhile."""
        key = self._key(LATEST)
        while True:
            try:
                current = self.s3.get_object(Bucket=self.bucket, Key=key)
                latest = latest_ref(current["Body"].read().decode(), f"s3://{self.bucket}/{key}")
                condition = {"IfMatch": current["ETag"]}
            except self.s3.exceptions.NoSuchKey:
                latest, condition = None, {"IfNoneMatch": "*"}
            if latest is not None and ref < latest:
                raise StaleVersion(f"version {ref} is older than LATEST {latest}")
            try:
                self.s3.put_object(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32", **condition,
                                   Body=json.dumps({"lineage": ref.lineage, "version": ref.version}).encode())
                return
            except self.s3.exceptions.ClientError as exc:
                if exc.response["Error"]["Code"] not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise  # else LATEST moved between the read and the write: read it again

    def _discard(self, staging: Staging) -> None:
        shutil.rmtree(staging.directory, ignore_errors=True)
        if staging.part == 0:  # objects some rank uploaded for a version that will never have a manifest
            self._delete_keys(self._key(version_name(staging.ref)) + "/")
            self._delete_keys(self._key(".parts", version_name(staging.ref)) + "/")

    def _fetch(self, ref: VersionRef, cache: Path) -> Path:
        manifest = self._get_json(self._key(version_name(ref), MANIFEST))
        if manifest is None:
            raise IncompleteVersion(f"version {ref} is not published in s3://{self.bucket}/{self.prefix}")
        directory = cache / version_name(ref)
        directory.mkdir(parents=True, exist_ok=True)

        def one(name: str) -> None:
            self.s3.download_file(self.bucket, self._key(version_name(ref), name), str(directory / name),
                                  Config=self.transfer)

        try:
            with ThreadPoolExecutor(self.files_in_parallel) as pool:
                list(pool.map(one, manifest["files"]))
        except self.s3.exceptions.ClientError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise IncompleteVersion(f"version {ref}: {exc}") from None
        _write_atomic(directory / MANIFEST, json.dumps(manifest))
        return directory

    def _versions(self) -> list[VersionRef]:
        paginator = self.s3.get_paginator("list_objects_v2")
        refs = set()
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + "/", Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                ref = parse_name(common["Prefix"][len(self.prefix) + 1:].rstrip("/"))
                if ref is not None:
                    refs.add(ref)
        return sorted(refs)

    def _clear_leftovers(self, latest: VersionRef) -> None:
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(".parts") + "/", Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                ref = parse_name(common["Prefix"].rstrip("/").rsplit("/", 1)[1])
                if ref is not None and ref <= latest:
                    self._delete_keys(common["Prefix"])

    def _delete(self, ref: VersionRef) -> None:
        # The manifest goes first: from then on the version does not exist for readers.
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(version_name(ref), MANIFEST))
        self._delete_keys(self._key(version_name(ref)) + "/")

    def _delete_keys(self, prefix: str) -> None:
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


class MemoryFile(io.RawIOBase):
    """A seekable read-only file over a memoryview, so s3transfer uploads a file image straight from memory."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.position))
        buffer[:n] = self.view[self.position:self.position + n]
        self.position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position


def open_store(cfg: WeightStoreConfig, default_path: Path) -> WeightStore:
    if cfg.kind == "s3":
        return S3Store(cfg.bucket, cfg.prefix, cfg.endpoint_url, cfg.keep_versions)
    return DirectoryStore(cfg.path or default_path, cfg.keep_versions)
