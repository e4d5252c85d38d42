"""Reading synthesized CloudFormation templates in tests."""
from __future__ import annotations

import json


def resources_of(template: dict, resource_type: str) -> dict[str, dict]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == resource_type}


def join_string(value) -> str:
    """A string property, with every CloudFormation reference inside it replaced by TOKEN."""
    if isinstance(value, str):
        return value
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


def pool(template: dict, role: str) -> tuple[dict, dict]:
    """(nodegroup properties, launch template data) of the pool with ``moe-rl/role=role``."""
    for ng in resources_of(template, "AWS::EKS::Nodegroup").values():
        props = ng["Properties"]
        if props["Labels"].get("moe-rl/role") == role:
            lt = template["Resources"][props["LaunchTemplate"]["Id"]["Ref"]]
            return props, lt["Properties"]["LaunchTemplateData"]
    raise AssertionError(f"no {role} pool")
