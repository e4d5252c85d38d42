"""The example runs are synthesized once per session (cdk8s starts a Node process: ~3 s) and shared."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from manifest_helpers import CLUSTER_RUNS, EXAMPLE_OUTPUTS, ROOT, run_file


os.environ.setdefault("JSII_RUNTIME_PACKAGE_CACHE_ROOT", str(ROOT / ".cache" / "jsii"))
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


@pytest.fixture(scope="session")
def dist(tmp_path_factory) -> Path:
    """dist/ of every example cluster run, written by the same entry point `make manifests` calls."""
    from moe_rl_eks.k8s.manifests import main

    out = tmp_path_factory.mktemp("dist")
    for name in CLUSTER_RUNS:
        assert main(["--run", str(run_file(name)), "--outputs", str(EXAMPLE_OUTPUTS), "--out", str(out),
                     "--cdk-json", str(ROOT / "cdk.json")]) == 0
    return out


@pytest.fixture(scope="session")
def manifests(dist) -> dict[str, list[dict]]:
    """'<run>/<file>' -> the objects in it."""
    return {f"{p.parent.name}/{p.name}": [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(dist.glob("*/*/*.k8s.yaml"))}


@pytest.fixture(scope="session")
def objects(manifests) -> list[dict]:
    return [obj for docs in manifests.values() for obj in docs]
