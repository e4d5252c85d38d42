"""checkov (kubernetes) on every example manifest: no finding outside the committed skip list, no stale skip."""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from manifest_helpers import ROOT

CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
SKIPS = yaml.safe_load((ROOT / "tests" / "k8s" / "checkov_skips.yaml").read_text())


def with_jobset_jobs(objects: list[dict]) -> list[dict]:
    """checkov does not know JobSet: add each replicated Job as a plain Job so its pod template is checked."""
    out = list(objects)
    for obj in objects:
        if obj["kind"] == "JobSet":
            for rjob in obj["spec"]["replicatedJobs"]:
                out.append({"apiVersion": "batch/v1", "kind": "Job",
                            "metadata": {"name": f"{obj['metadata']['name']}-{rjob['name']}",
                                         "namespace": obj["metadata"]["namespace"]},
                            "spec": rjob["template"]["spec"]})
    return out


@pytest.fixture(scope="module")
def findings(objects, tmp_path_factory) -> list[tuple[str, str]]:
    assert CHECKOV.exists(), "checkov is missing: `make bootstrap` installs it into .venv-checkov"
    folder = tmp_path_factory.mktemp("checkov")
    (folder / "manifests.yaml").write_text(yaml.safe_dump_all(with_jobset_jobs(objects)))
    proc = subprocess.run([str(CHECKOV), "--framework", "kubernetes", "--skip-download", "--quiet", "--compact",
                           "-o", "json", "-d", str(folder)], capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1 = some check failed
    report = json.loads(proc.stdout)
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["resource_count"] >= len(objects)
    return [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]]


def test_every_skip_has_a_reason():
    for skip in SKIPS:
        assert set(skip) == {"check", "resources", "reason"} and len(skip["reason"]) > 40, skip


def test_checkov_finds_nothing_outside_the_skip_list(findings):
    unexplained = [(check, resource) for check, resource in findings
                   if not any(s["check"] == check and re.fullmatch(s["resources"], resource) for s in SKIPS)]
    assert unexplained == []


def test_every_skip_is_still_needed(findings):
    stale = [s["check"] for s in SKIPS
             if not any(s["check"] == check and re.fullmatch(s["resources"], resource) for check, resource in findings)]
    assert stale == []
