"""Shared by the k8s tests: where things are, and how to reach the pod specs inside objects."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[2]
DATA = Path(__file__).parent / "data"
EXAMPLE_OUTPUTS = DATA / "outputs.example.json"
CLUSTER_RUNS = ("dev-small", "qwen3-30b-a3b-p5")


def run_file(name: str) -> Path:
    return ROOT / "configs" / "runs" / f"{name}.yaml"


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_specs(obj: dict) -> list[dict]:
    """Every pod spec an object creates: Deployments and Jobs directly, JobSets through their Job templates."""
    if obj["kind"] in ("Deployment", "Job"):
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"]["spec"] for rj in obj["spec"]["replicatedJobs"]]
    return []
