"""The image definitions: lint-clean, every version pinned in one place, each image's entry points in the
package, and `make images` building the commands it would run (this machine has no Docker engine)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from moe_rl_eks.tools.cli import SUBCOMMANDS
from moe_rl_eks.core.deploy import IMAGE_ROLES
from moe_rl_eks.core.container import DEEPEP_VARIANTS, ROLE_COMMANDS

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
SCRIPTS = sorted((IMAGES / "scripts").glob("*.sh")) + [IMAGES / "h200_check.sh"]
BIN = Path(sys.executable).parent


def _load_build():
    spec = importlib.util.spec_from_file_location("images_build", IMAGES / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


build = _load_build()
REGISTRY = "111111111111.dkr.ecr.us-east-1.amazonaws.com/moe-rl-dev"


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: it comes with the dev extra (pyproject.toml)")
    return path


def test_dockerfiles_are_hadolint_clean():
    result = subprocess.run([_tool("hadolint"), "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_says_why():
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.startswith("# hadolint ignore="):
                reasons = [l for l in lines[max(0, number - 3):number] if l.startswith("#") and "hadolint" not in l]
                assert reasons, f"{dockerfile.name}:{number + 1}: an ignore without a reason above it"


def test_build_scripts_are_shellcheck_clean():
    result = subprocess.run([_tool("shellcheck"), "-x", "--source-path=SCRIPTDIR", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=IMAGES)
    assert result.returncode == 0, result.stdout + result.stderr


def _declared_args(dockerfile: Path) -> dict[str, str | None]:
    """ARG name -> its default (None when it has none)."""
    args = {}
    for match in re.finditer(r"^ARG (\w+)(?:=(.*))?$", dockerfile.read_text(), re.M):
        args[match.group(1)] = match.group(2)
    return args


def test_every_version_comes_from_versions_env_without_defaults():
    versions = build.read_versions()
    supplied = set(build.build_args(versions, {versions[k]: "sha256:" + "1" * 64 for k in build.BASE_IMAGE_ARGS}))
    declared = {}
    for dockerfile in DOCKERFILES:
        for name, default in _declared_args(dockerfile).items():
            assert default is None, f"{dockerfile.name}: ARG {name} has a default; versions come from versions.env"
            declared[name] = dockerfile.name
    assert set(declared) <= supplied, f"declared but never supplied: {sorted(set(declared) - supplied)}"
    assert supplied <= set(declared), f"pinned but used by no Dockerfile: {sorted(supplied - set(declared))}"


def test_versions_are_exact():
    versions = build.read_versions()
    for key in build.BASE_IMAGE_ARGS:
        assert re.fullmatch(r"[a-z0-9/._-]+:\d+\.\d+\.\d+-[a-z0-9.-]+", versions[key]), (key, versions[key])
    for key, value in versions.items():
        if key.endswith("_COMMIT"):
            assert re.fullmatch(r"[0-9a-f]{40}", value), f"{key}={value}: a full commit hash"
        elif key.endswith("_SHA256"):
            assert re.fullmatch(r"[0-9a-f]{64}", value), f"{key}={value}"
        elif key.endswith("_VERSION"):
            assert re.fullmatch(r"v?\d+(\.\d+)+(-\d+)?", value), f"{key}={value}: an exact version"
    assert versions["DEEPEP_VARIANT"] in DEEPEP_VARIANTS
    # The EFA patch supports NVSHMEM >= 3.7 and this DeepEP commit only (REFERENCE.md).
    assert tuple(map(int, versions["NVSHMEM_VERSION"].split("."))) >= (3, 7, 0)
    assert versions["DEEPEP_COMMIT"].startswith("567632d")
    assert set(versions["TORCH_CUDA_ARCH_LIST"].split(";")) >= {"9.0", "10.0"}


def test_base_images_are_only_referenced_through_pinned_arguments():
    for dockerfile in DOCKERFILES:
        stages = set()
        for line in dockerfile.read_text().splitlines():
            if line.startswith("FROM "):
                source = line.split()[1]
                assert source in stages or re.fullmatch(r"\$\{(\w+)\}", source), f"{dockerfile.name}: {line}"
                if source not in stages:
                    assert source[2:-1] in build.BASE_IMAGE_ARGS
                stages.add(line.split()[-1])


def test_python_installs_are_pinned():
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "pip install" not in line:
                continue
            packages = [w.strip('"') for w in line.split("pip install", 1)[1].split("&&")[0].split()
                        if not w.startswith("-") and not w.startswith('"$') and "/" not in w and "==" not in w]
            assert packages == [], f"{dockerfile.name}: unpinned {packages} in: {line.strip()}"
    # The package's own dependencies are held to constraints.txt by install_package.sh: each must be pinned there.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = project["dependencies"] + project["optional-dependencies"]["workloads"] + \
        project["optional-dependencies"]["kernels"]
    pinned = {re.split(r"==", line)[0].strip().lower().replace("_", "-")
              for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line and not line.startswith("#")}
    names = {re.split(r"[<>=!~\[; ]", dep, 1)[0].lower().replace("_", "-") for dep in needed}
    assert names - pinned == set(), f"dependencies of the images not pinned in constraints.txt: {sorted(names - pinned)}"


def test_each_image_runs_its_doctor_and_its_entry_points_exist():
    assert [image.name for image in build.IMAGES] == list(IMAGE_ROLES)  # one image per deploy.images field
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["moerl"] == "moe_rl_eks.tools.cli:main"
    for image in build.IMAGES:
        dockerfile = (REPO / image.dockerfile).read_text()
        stage = dockerfile.split(f" AS {image.target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert f'CMD ["moerl", "doctor", "--role", "{image.name}"]' in stage
        assert "USER 10001:10001" in stage
        command = ROLE_COMMANDS[image.name]
        module, func, _ = SUBCOMMANDS[command]
        assert callable(getattr(importlib.import_module(module), func)), f"{image.name}: moerl {command}"
    # install_package.sh checks in the build that the roles an image serves import from the installed package.
    installs = {d.name: re.findall(r"install_package\.sh \S+ (\S+) (\S+)", d.read_text()) for d in DOCKERFILES}
    assert installs == {"gpu.Dockerfile": [("workloads,kernels", "trainer,rollout")],
                        "orchestrator.Dockerfile": [("workloads", "orchestrator")]}


def test_build_context_holds_what_the_dockerfiles_copy_and_nothing_else():
    rules = [l for l in (REPO / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert rules[0] == "*", "allow-list: everything is excluded first"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = set()
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                copied.update(p.rstrip("/") for p in line.split()[1:-1])
    def under(path: str, folder: str) -> bool:
        return path == folder or path.startswith(folder + "/")

    assert {c for c in copied if not any(under(c, a) for a in allowed)} == set(), "copied but excluded"
    assert {a for a in allowed if not any(under(c, a) for c in copied)} == set(), "sent but never copied"
    for path in copied:
        assert (REPO / path).exists(), path


def test_dry_run_resolves_base_digests_then_builds_and_pushes_three_images(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "LOCK_FILE", tmp_path / "base-images.lock")
    assert build.main(["--registry", REGISTRY, "--tag", "v0.1.0", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    versions = build.read_versions()
    assert lines[:3] == [f"docker buildx imagetools inspect {versions[k]} --format '{{{{json .Manifest}}}}'"
                         for k in build.BASE_IMAGE_ARGS]
    builds = [line for line in lines if line.startswith("docker buildx build")]
    assert [re.search(r"--tag (\S+)", b).group(1) for b in builds] == [
        f"{REGISTRY}/trainer:v0.1.0", f"{REGISTRY}/rollout:v0.1.0", f"{REGISTRY}/orchestrator:v0.1.0"]
    for line in builds:
        assert "--platform linux/amd64" in line and line.endswith("--push .")
    assert not (tmp_path / "base-images.lock").exists(), "a dry run writes nothing"


def test_pushes_to_the_repositories_in_the_stack_outputs(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "LOCK_FILE", tmp_path / "base-images.lock")
    example = REPO / "tests" / "k8s" / "data" / "outputs.example.json"
    assert build.main(["--outputs", str(example), "--env", "prod", "--tag", "v0.2.0", "--dry-run"]) == 0
    tags = re.findall(r"--tag (\S+)", capsys.readouterr().out)
    stack = json.loads(example.read_text())["MoeRlEks-prod"]
    assert tags == [f"{stack[key]}:v0.2.0" for key in ("TrainerRepositoryUri", "RolloutRepositoryUri",
                                                       "OrchestratorRepositoryUri")]
    assert build.main(["--outputs", str(example), "--env", "staging", "--tag", "v0.2.0", "--dry-run"]) == 2
    assert "known environments: dev, prod" in capsys.readouterr().err


def test_builds_from_the_lock_when_present(capsys, tmp_path, monkeypatch):
    lock = tmp_path / "base-images.lock"
    versions = build.read_versions()
    digests = {versions[k]: f"sha256:{i}" + "a" * 63 for i, k in enumerate(build.BASE_IMAGE_ARGS)}
    build.write_lock(digests, lock)
    assert json.loads(lock.read_text()) == dict(sorted(digests.items()))
    monkeypatch.setattr(build, "LOCK_FILE", lock)
    assert build.main(["--registry", REGISTRY, "--tag", "v0.1.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "imagetools inspect" not in out
    trainer = next(line for line in out.splitlines() if "--target trainer" in line)
    devel = versions["CUDA_DEVEL_IMAGE"]
    assert f"--build-arg CUDA_DEVEL_IMAGE={devel}@{digests[devel]}" in trainer
    assert "--build-arg NVSHMEM_REMOTE_TRANSPORT=libfabric" in trainer
    assert f"--build-arg DEEPEP_COMMIT={versions['DEEPEP_COMMIT']}" in trainer


def test_malformed_lock_is_refused(tmp_path):
    lock = tmp_path / "base-images.lock"
    lock.write_text('{"nvidia/cuda:13.0.2-devel-ubuntu24.04": "latest"}')
    with pytest.raises(build.BuildError, match="expected .*sha256:<64 hex>"):
        build.read_lock(lock)


@pytest.mark.parametrize("registry, tag, message", [
    (REGISTRY, "latest", "--tag 'latest': floating tags"),
    (REGISTRY, "sha256:" + "a" * 64, "a tag to push, not a digest"),
    ("https://registry.example.com", "v1", "--registry 'https://registry.example.com': expected a registry"),
])
def test_bad_registry_or_tag_is_named(registry, tag, message, capsys):
    assert build.main(["--registry", registry, "--tag", tag, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(build.docker_available(), reason="a Docker engine with buildx is present")
def test_without_docker_the_build_fails_clearly(capsys):
    assert build.main(["--registry", REGISTRY, "--tag", "v0.1.0"]) == 2
    assert "docker with buildx and a running engine is not available here" in capsys.readouterr().err


def test_make_images_runs_the_build_script_with_outputs_or_registry_and_tag():
    result = subprocess.run(["make", "-n", "--no-print-directory", "images", f"REGISTRY={REGISTRY}", "TAG=v0.1.0"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert f"images/build.py --registry {REGISTRY} --tag v0.1.0" in result.stdout
    result = subprocess.run(["make", "-n", "--no-print-directory", "images", "OUTPUTS=out.json", "ENV=dev", "TAG=v1"],
                            capture_output=True, text=True, cwd=REPO)
    assert "images/build.py --outputs out.json --env dev --tag v1" in result.stdout
    usage = subprocess.run(["make", "--no-print-directory", "images"], capture_output=True, text=True, cwd=REPO)
    assert usage.returncode == 2 and "usage: make images OUTPUTS=" in usage.stdout


def test_install_package_script_installs_the_wheel_and_imports_every_role(tmp_path):
    # The script the Dockerfiles run, here with what this environment already holds (--offline), into a target
    # folder placed first on the path: the roles must import from the installed wheel, not from the source tree.
    target = tmp_path / "site"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PIP_TARGET": str(target), "PYTHONPATH": str(target),
           "HOME": str(tmp_path), "PIP_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(["bash", str(IMAGES / "scripts" / "install_package.sh"), "--offline", str(REPO),
                             "workloads,kernels", ",".join(IMAGE_ROLES)],
                            capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for role in IMAGE_ROLES:
        assert f"{role}: moerl {ROLE_COMMANDS[role]} -> " in result.stdout
    where = subprocess.run([sys.executable, "-c", "import moe_rl_eks.tools.cli as c; print(c.__file__)"],
                           capture_output=True, text=True, env=env, cwd="/")
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr
