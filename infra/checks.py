"""Synthesis-time checks: cdk-nag's AwsSolutions pack and our own EKS guardrails.

cdk-nag's EKS1 (public endpoint) and EKS2 (control-plane logs) only inspect the aws_eks v1 construct, so they never
fire for aws_eks_v2 clusters; :class:`EksGuardrails` checks the synthesized AWS::EKS::Cluster resources instead.
"""
from __future__ import annotations

import ipaddress
import json

import jsii
from aws_cdk import (IPolicyValidationContext, IPolicyValidationPlugin, PolicyValidationPluginReport,
                     PolicyViolatingResource, PolicyViolation, Stack, Stage, Token, Validations)
from cdk_nag import AwsSolutionsChecks

def nag_partition(stack: Stack) -> str:
    """The partition as cdk-nag prints it in a finding's id: a literal where the app sets
    `@aws-cdk/core:enablePartitionLiterals` (new apps do) and the region is known, else the pseudo parameter."""
    return "<AWS::Partition>" if Token.is_unresolved(stack.partition) else stack.partition


REQUIRED_LOG_TYPES = frozenset({"api", "audit", "authenticator", "controllerManager", "scheduler"})


def cluster_violations(template: dict) -> list[tuple[str, str, str]]:
    """(rule, logical id, description) for each EKS cluster in ``template`` that breaks a guardrail."""
    found = []
    for logical_id, resource in template.get("Resources", {}).items():
        if resource.get("Type") != "AWS::EKS::Cluster":
            continue
        props = resource.get("Properties", {})
        vpc = props.get("ResourcesVpcConfig", {})
        # CloudFormation's default for EndpointPublicAccess is true.
        if vpc.get("EndpointPublicAccess", True):
            cidrs = vpc.get("PublicAccessCidrs") or []
            if not cidrs or any(_is_everywhere(c) for c in cidrs):
                found.append(("MoeRl-EKS-PublicEndpoint", logical_id,
                              f"public API endpoint open to {cidrs or ['0.0.0.0/0 (default)']}; keep it private or "
                              "give PublicAccessCidrs an allow-list"))
        enabled = {entry.get("Type") for entry in props.get("Logging", {}).get("ClusterLogging", {}).get("EnabledTypes", [])}
        missing = sorted(REQUIRED_LOG_TYPES - enabled)
        if missing:
            found.append(("MoeRl-EKS-ControlPlaneLogs", logical_id,
                          f"control-plane log types off: {', '.join(missing)}; enable all of {sorted(REQUIRED_LOG_TYPES)}"))
    return found


def _is_everywhere(cidr) -> bool:
    """0.0.0.0/0 or ::/0; a value that is no CIDR at all counts as no allow-list."""
    if not isinstance(cidr, str):
        return False  # a CloudFormation reference: not decidable here
    try:
        return ipaddress.ip_network(cidr, strict=False).prefixlen == 0
    except ValueError:
        return True


@jsii.implements(IPolicyValidationPlugin)
class EksGuardrails:
    """Validation plugin: fails synthesis on a public endpoint without an allow-list or a disabled log type."""

    @property
    def name(self) -> str:
        return "moe-rl-eks-guardrails"

    @property
    def version(self) -> str:
        return "1.0.0"

    @property
    def rule_ids(self) -> list[str]:
        return ["MoeRl-EKS-PublicEndpoint", "MoeRl-EKS-ControlPlaneLogs"]

    def validate(self, context: IPolicyValidationContext) -> PolicyValidationPluginReport:
        violations: dict[tuple[str, str], list[PolicyViolatingResource]] = {}
        for path in context.template_paths:
            with open(path) as f:
                template = json.load(f)
            for rule, logical_id, description in cluster_violations(template):
                violations.setdefault((rule, description), []).append(
                    PolicyViolatingResource(resource_logical_id=logical_id, template_path=path, locations=["Properties"]))
        return PolicyValidationPluginReport(
            success=not violations,
            violations=[PolicyViolation(rule_name=rule, description=description, violating_resources=resources,
                                        severity="error")
                        for (rule, description), resources in violations.items()])


def add_checks(scope: Stage) -> None:
    """Run cdk-nag AwsSolutions and our EKS guardrails on every template synthesized in ``scope`` (App or Stage)."""
    Validations.of(scope).add_plugins(AwsSolutionsChecks(scope), EksGuardrails())
