"""Shared by the infra tests: where things are, the offline process environment, reading synthesized templates."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CDK = REPO / "node_modules" / ".bin" / "cdk"
ENVIRONMENTS = tuple(json.loads((REPO / "cdk.json").read_text())["context"]["environments"])
SYNTH_TIMEOUT_S = 240


def offline_env() -> dict[str, str]:
    """The process environment for synthesis: no AWS credentials or config, caches inside the repo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null", AWS_EC2_METADATA_DISABLED="true",
        JSII_RUNTIME_PACKAGE_CACHE_ROOT=str(REPO / ".cache" / "jsii"), CDK_HOME=str(REPO / ".cache" / "cdk"),
        JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION="20", CDK_DISABLE_VERSION_CHECK="1",
        CDK_DISABLE_CLI_TELEMETRY="true", CDK_VALIDATION="false", OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return env


def resources_of(template: dict, resource_type: str) -> dict[str, dict]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == resource_type}


def join_string(value) -> str:
    """A string property, with every CloudFormation reference inside it replaced by TOKEN."""
    if isinstance(value, str):
        return value
    if "Fn::Join" not in value:  # a bare Ref / Fn::GetAtt
        return "TOKEN"
    parts = value["Fn::Join"][1]
    return "".join(p if isinstance(p, str) else "TOKEN" for p in parts)


def kubernetes_objects(template: dict) -> list[dict]:
    objects = []
    for res in resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource").values():
        objects += json.loads(join_string(res["Properties"]["Manifest"]))
    return objects


def helm_charts(template: dict) -> dict[str, dict]:
    return {r["Properties"]["Release"]: {**r["Properties"], "Values": json.loads(join_string(r["Properties"].get("Values", "{}")))}
            for r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").values()}


# The core kinds the stack applies through the kubectl provider (the rest are Kueue's).
STACK_CORE_KINDS = {"Namespace", "ServiceAccount", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Job",
                    "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}


def strictly_validated_kinds(template: dict) -> set[str]:
    """The kinds of the template's core Kubernetes objects, each validated with kubernetes-validate --strict at the
    Kubernetes version of the template's cluster."""
    import kubernetes_validate

    (cluster,) = resources_of(template, "AWS::EKS::Cluster").values()
    kinds = set()
    for obj in kubernetes_objects(template):
        if obj["apiVersion"].startswith("kueue.x-k8s.io/"):
            continue  # Kueue's own webhooks check these once its chart is up (applied after it)
        # CloudFormation tokens (ARNs, file-system ids) become strings here; their shape is not what is checked.
        kubernetes_validate.validate(json.loads(json.dumps(obj).replace('"TOKEN"', '"x"')),
                                     cluster["Properties"]["Version"], strict=True)
        kinds.add(obj["kind"])
    return kinds


def pool(template: dict, role: str) -> tuple[dict, dict]:
    """(nodegroup properties, launch template data) of the pool with ``moe-rl/role=role``."""
    for ng in resources_of(template, "AWS::EKS::Nodegroup").values():
        props = ng["Properties"]
        if props["Labels"].get("moe-rl/role") == role:
            lt = template["Resources"][props["LaunchTemplate"]["Id"]["Ref"]]
            return props, lt["Properties"]["LaunchTemplateData"]
    raise AssertionError(f"no {role} pool")
