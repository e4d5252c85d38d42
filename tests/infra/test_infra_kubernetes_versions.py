"""Each accepted Kubernetes version gets its own kubectl layer, KEDA release and autoscaler image. The 1.36 stack is
synthesized as a user would: `cdk synth -c env=dev` (the CDK CLI, offline) in a project whose cdk.json sets dev's
kubernetes_version to 1.36; app.py adds cdk-nag and the EKS guardrails, so any finding fails that synthesis."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_rl_eks.infra.services import CHARTS, KUBERNETES_PINS

from infra_helpers import (CDK, REPO, STACK_CORE_KINDS, SYNTH_TIMEOUT_S, helm_charts, offline_env, resources_of,
                           strictly_validated_kinds)

# the session's `cdk synth` of every environment (conftest.cdk_out) runs once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("cdk_out")


@pytest.fixture(scope="module")
def template_1_36(tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("kubernetes-1.36")
    cdk_json = json.loads((REPO / "cdk.json").read_text())
    cdk_json["app"] = f"{sys.executable} {REPO / 'app.py'}"
    cdk_json["context"]["environments"]["dev"]["kubernetes_version"] = "1.36"
    (project / "cdk.json").write_text(json.dumps(cdk_json))
    proc = subprocess.run([str(CDK), "synth", "--no-notices", "-q", "-c", "env=dev", "-o", str(project / "cdk.out")],
                          cwd=project, env=offline_env(), capture_output=True, text=True, timeout=SYNTH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(next((project / "cdk.out").glob("*.template.json")).read_text())


def kubectl_binary(template: dict) -> str:
    """What the kubectl provider's layer ships, as its description says ('/opt/kubectl/kubectl 1.36.3; ...')."""
    (layer,) = [r["Properties"]["Description"] for r in resources_of(template, "AWS::Lambda::LayerVersion").values()
                if r["Properties"]["Description"].startswith("/opt/kubectl/kubectl ")]
    return layer.split(";")[0].removeprefix("/opt/kubectl/kubectl ")


def test_a_1_36_environment_gets_a_1_36_cluster_with_1_36s_kubectl_keda_and_autoscaler(template_1_36):
    (cluster,) = resources_of(template_1_36, "AWS::EKS::Cluster").values()
    assert cluster["Properties"]["Version"] == "1.36"
    assert kubectl_binary(template_1_36).startswith("1.36.")
    charts = helm_charts(template_1_36)
    # KEDA 2.21 is the release tested on 1.36; the autoscaler image is the 1.36 release.
    assert charts["keda"]["Version"] == KUBERNETES_PINS["1.36"].keda.version == "2.21.0"
    assert charts["cluster-autoscaler"]["Values"]["image"]["tag"] == "v1.36.1"
    assert {name: c["Version"] for name, c in charts.items() if name != "keda"} == \
        {name: c.version for name, c in CHARTS.items()}


def test_the_default_1_35_environments_keep_1_35s_kubectl_keda_and_autoscaler(templates):
    for env in ("dev", "prod"):
        assert kubectl_binary(templates[env]).startswith("1.35."), env
        charts = helm_charts(templates[env])
        assert charts["keda"]["Version"] == "2.20.2", env
        assert charts["cluster-autoscaler"]["Values"]["image"]["tag"] == "v1.35.0", env


def test_every_core_object_of_the_1_36_stack_passes_strict_validation_at_1_36(template_1_36):
    assert strictly_validated_kinds(template_1_36) == STACK_CORE_KINDS
