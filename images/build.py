"""Build and push the three images with docker buildx: `make images (OUTPUTS=... ENV=... | REGISTRY=...) TAG=...`.

    python images/build.py --outputs cdk.out/dev-outputs.json --env dev --tag v0.1.0
    python images/build.py --registry 111111111111.dkr.ecr.us-east-1.amazonaws.com/moe-rl-dev --tag v0.1.0

pushes the trainer, rollout and orchestrator images (linux/amd64) to the stack's ECR repositories named in the
`cdk deploy --outputs-file` file, or to `<registry>/<image>:<tag>`, and prints each image's digest and the
`deploy.images` block for a run file. Every version comes from
images/versions.env, passed as build arguments. Base images are named there by exact tag; the first build
resolves each to its digest (`docker buildx imagetools inspect`) and records it in images/base-images.lock, and
every build after that uses `tag@digest` from the lock (`--refresh-lock` resolves again). `--dry-run` prints
the commands instead of running them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moe_rl_eks.core.deploy import IMAGE_ROLES, image_version_problem
from moe_rl_eks.core.environment import load_cdk_json, select_environment
from moe_rl_eks.core.schema import ConfigError

IMAGES_DIR = Path(__file__).resolve().parent
REPO_ROOT = IMAGES_DIR.parent
VERSIONS_FILE = IMAGES_DIR / "versions.env"
LOCK_FILE = IMAGES_DIR / "base-images.lock"
PLATFORM = "linux/amd64"
BASE_IMAGE_ARGS = ("CUDA_DEVEL_IMAGE", "CUDA_RUNTIME_IMAGE", "PYTHON_IMAGE")
# What NVSHMEM must use to reach other nodes, per DeepEP variant: the EFA patch goes through libfabric; stock
# V1 through InfiniBand (its RC transport; its GPU-initiated kernels need IBGDA, which EFA lacks).
NVSHMEM_TRANSPORT = {"efa-v1": "libfabric", "stock-v1": "ibrc"}
_TAGGED_REFERENCE = re.compile(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_REGISTRY = re.compile(r"[a-z0-9]+(?:[.-][a-z0-9]+)*(?::\d+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")


class BuildError(Exception):
    pass


@dataclass(frozen=True)
class Image:
    name: str  # the role it serves (core.deploy.IMAGE_ROLES): its doctor's role and its repository
    dockerfile: str
    target: str


IMAGES = (
    Image("trainer", "images/gpu.Dockerfile", "trainer"),
    Image("rollout", "images/gpu.Dockerfile", "rollout"),
    Image("orchestrator", "images/orchestrator.Dockerfile", "orchestrator"),
)


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), each value non-empty and each base image tagged."""
    versions: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key) or not value:
            raise BuildError(f"{path.name}:{number}: expected KEY=VALUE with an upper-case key and a value, got {line!r}")
        if key in versions:
            raise BuildError(f"{path.name}:{number}: {key} is set twice")
        versions[key] = value
    for key in BASE_IMAGE_ARGS:
        ref = versions.get(key)
        if ref is None or not _TAGGED_REFERENCE.fullmatch(ref) or ref.rsplit(":", 1)[1] == "latest":
            raise BuildError(f"{path.name}: {key}={ref!r}: expected a base image with an exact tag (name:tag, not latest)")
    variant = versions.get("DEEPEP_VARIANT")
    if variant not in NVSHMEM_TRANSPORT:
        raise BuildError(f"{path.name}: DEEPEP_VARIANT={variant!r}: allowed: {', '.join(NVSHMEM_TRANSPORT)}")
    return versions


def read_lock(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    lock = json.loads(path.read_text())
    if not isinstance(lock, dict) or not all(isinstance(v, str) and _DIGEST.fullmatch(v) for v in lock.values()):
        raise BuildError(f"{path.name}: expected {{\"image:tag\": \"sha256:<64 hex>\"}}; delete it or run with --refresh-lock")
    return lock


def write_lock(lock: dict[str, str], path: Path) -> None:
    # Written whole to a temporary file and renamed: an interrupted build never leaves half a lock behind.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(json.dumps(dict(sorted(lock.items())), indent=2) + "\n")
    os.replace(tmp.name, path)


def inspect_command(ref: str) -> list[str]:
    return ["docker", "buildx", "imagetools", "inspect", ref, "--format", "{{json .Manifest}}"]


def resolve_digest(ref: str) -> str:
    """The digest of `ref`'s manifest (the multi-platform index when it is one), from its registry."""
    result = subprocess.run(inspect_command(ref), capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"cannot resolve {ref}: {result.stderr.strip() or result.stdout.strip()}")
    digest = json.loads(result.stdout).get("digest", "")
    if not _DIGEST.fullmatch(digest):
        raise BuildError(f"cannot resolve {ref}: the registry answered no sha256 digest ({result.stdout.strip()[:200]})")
    return digest


def build_args(versions: dict[str, str], lock: dict[str, str]) -> dict[str, str]:
    """Build arguments: the versions, base images as tag@digest from the lock, the variant's NVSHMEM transport."""
    args = dict(versions)
    for key in BASE_IMAGE_ARGS:
        args[key] = f"{versions[key]}@{lock[versions[key]]}"
    args["NVSHMEM_REMOTE_TRANSPORT"] = NVSHMEM_TRANSPORT[versions["DEEPEP_VARIANT"]]
    return args


def build_command(image: Image, args: dict[str, str], reference: str, metadata_file: Path, *, push: bool) -> list[str]:
    command = ["docker", "buildx", "build", "--platform", PLATFORM, "--file", image.dockerfile,
               "--target", image.target, "--tag", reference, "--metadata-file", str(metadata_file)]
    for key, value in sorted(args.items()):
        command += ["--build-arg", f"{key}={value}"]
    command += ["--push" if push else "--load", "."]
    return command


def repositories(args: argparse.Namespace) -> dict[str, str]:
    """Image name -> repository: from the stack's outputs file, or `<registry>/<image>`."""
    if args.outputs:
        from moe_rl_eks.k8s.outputs import load_outputs
        try:
            env = select_environment(load_cdk_json(args.cdk_json), args.env)
            outputs = load_outputs(args.outputs, env)
        except (ConfigError, FileNotFoundError) as exc:
            raise BuildError(str(exc)) from None
        return {name: getattr(outputs, f"{name}_repository_uri") for name in IMAGE_ROLES}
    if not _REGISTRY.fullmatch(args.registry):
        raise BuildError(f"--registry {args.registry!r}: expected a registry and repository prefix without scheme "
                         "or tag, like 111111111111.dkr.ecr.us-east-1.amazonaws.com/moe-rl-dev")
    return {name: f"{args.registry}/{name}" for name in IMAGE_ROLES}


def check_tag(tag: str) -> None:
    problem = image_version_problem(tag)
    if problem or tag.startswith("sha256:"):
        raise BuildError(f"--tag {tag!r}: {problem or 'a tag to push, not a digest'}")


def docker_available() -> bool:
    """A docker CLI with the buildx plugin and an engine that answers."""
    if shutil.which("docker") is None:
        return False
    return all(subprocess.run(command, capture_output=True).returncode == 0
               for command in (["docker", "buildx", "version"], ["docker", "info"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--outputs", help="`cdk deploy --outputs-file` file: push to the stack's repositories")
    target.add_argument("--registry", help="registry and repository prefix: push to <registry>/<image>:<tag>")
    parser.add_argument("--env", help="environment in cdk.json whose stack --outputs names (required with it)")
    parser.add_argument("--cdk-json", default=str(REPO_ROOT / "cdk.json"), help="the environments (default: the repo's)")
    parser.add_argument("--tag", required=True, help="release tag (immutable in ECR; latest and the like are refused)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--no-push", action="store_true", help="load into the local engine instead of pushing")
    parser.add_argument("--refresh-lock", action="store_true", help="resolve every base image digest again")
    args = parser.parse_args(argv)
    if args.outputs and not args.env:
        parser.error("--outputs needs --env (the environment whose stack wrote it)")
    try:
        check_tag(args.tag)
        repository = repositories(args)
        versions = read_versions()
        lock = {} if args.refresh_lock else read_lock(LOCK_FILE)
        missing = [versions[key] for key in BASE_IMAGE_ARGS if versions[key] not in lock]
        if not args.dry_run and not docker_available():
            raise BuildError("docker with buildx and a running engine is not available here (`docker buildx "
                             "version` or `docker info` failed); `--dry-run` prints the commands")
        if missing:
            if args.dry_run:
                for ref in missing:
                    print(shlex.join(inspect_command(ref)))
                    lock[ref] = "sha256:" + "0" * 64  # placeholder, only for printing the build commands
                print(f"# (dry run) the digests above would be recorded in {LOCK_FILE}")
            else:
                for ref in missing:
                    lock[ref] = resolve_digest(ref)
                write_lock(lock, LOCK_FILE)
        arguments = build_args(versions, lock)
        digests = {}
        with tempfile.TemporaryDirectory() as tmp:
            for image in IMAGES:
                reference = f"{repository[image.name]}:{args.tag}"
                metadata = Path(tmp) / f"{image.name}.json"
                command = build_command(image, arguments, reference, metadata, push=not args.no_push)
                if args.dry_run:
                    print(shlex.join(command))
                    continue
                print(f"building {reference}", flush=True)
                if subprocess.run(command, cwd=REPO_ROOT).returncode != 0:
                    raise BuildError(f"docker buildx build of {reference} failed (its output is above)")
                digests[image.name] = json.loads(metadata.read_text()).get("containerimage.digest", "")
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if digests:
        print("\nimage         digest")
        for name, digest in digests.items():
            print(f"{name:13} {repository[name]}@{digest}")
        print("\n# for a run file (deploy.images):")
        print("deploy:\n  images:")
        for name, digest in digests.items():
            print(f"    {name}: \"{digest or args.tag}\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
