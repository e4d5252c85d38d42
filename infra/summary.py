"""`moerl synth-summary [CDK_OUT]`: what `make synth` produced, read from the CloudFormation JSON in
CDK_OUT/<env>/*.template.json (no aws_cdk import): stacks, and per node pool its instance type, sizes, EFA
interfaces and placement group."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_rl_eks.core.labels import ROLE_LABEL


@dataclass(frozen=True)
class PoolSummary:
    environment: str
    stack: str
    role: str
    instance_type: str
    capacity_type: str
    min_size: int
    max_size: int
    efa_interfaces: int
    placement: str  # placement group strategy, or "-"


def summarize_template(environment: str, stack: str, template: dict) -> list[PoolSummary]:
    resources = template.get("Resources", {})
    pools = []
    for logical_id, res in resources.items():
        if res.get("Type") != "AWS::EKS::Nodegroup":
            continue
        props = res.get("Properties", {})
        data = _launch_template_data(resources, props.get("LaunchTemplate", {}))
        efa = sum(1 for i in data.get("NetworkInterfaces", []) if i.get("InterfaceType") in ("efa", "efa-only"))
        scaling = props.get("ScalingConfig", {})
        pools.append(PoolSummary(
            environment=environment, stack=stack, role=props.get("Labels", {}).get(ROLE_LABEL, logical_id),
            # A capacity-block pool names its instance type in the launch template only.
            instance_type=",".join(props.get("InstanceTypes", [data.get("InstanceType", "?")])), capacity_type=props.get("CapacityType", "ON_DEMAND"),
            min_size=scaling.get("MinSize", 0), max_size=scaling.get("MaxSize", 0), efa_interfaces=efa,
            placement=_placement(resources, data)))
    return pools


def _launch_template_data(resources: dict, spec: dict) -> dict:
    ref = spec.get("Id", {})
    target = ref.get("Ref") if isinstance(ref, dict) else None
    return resources.get(target, {}).get("Properties", {}).get("LaunchTemplateData", {}) if target else {}


def _placement(resources: dict, data: dict) -> str:
    group = data.get("Placement", {}).get("GroupName")
    if isinstance(group, dict) and "Ref" in group:
        return resources.get(group["Ref"], {}).get("Properties", {}).get("Strategy", "?")
    return "-" if group is None else str(group)


def summarize(cdk_out: Path) -> tuple[list[str], list[PoolSummary]]:
    """Stacks ("env/stack") and pools of every environment folder under ``cdk_out``."""
    stacks, pools = [], []
    for template_path in sorted(cdk_out.glob("*/*.template.json")):
        environment, stack = template_path.parent.name, template_path.name.removesuffix(".template.json")
        stacks.append(f"{environment}/{stack}")
        pools += summarize_template(environment, stack, json.loads(template_path.read_text()))
    return stacks, pools


def format_table(pools: list[PoolSummary]) -> str:
    header = ("env", "stack", "pool", "instance type", "capacity", "min", "max", "EFA/node", "placement")
    rows = [header] + [(p.environment, p.stack, p.role, p.instance_type, p.capacity_type, str(p.min_size),
                        str(p.max_size), str(p.efa_interfaces), p.placement) for p in pools]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl synth-summary", description=__doc__)
    parser.add_argument("cdk_out", nargs="?", default="cdk.out", type=Path)
    args = parser.parse_args(argv)
    stacks, pools = summarize(args.cdk_out)
    if not stacks:
        print(f"moerl synth-summary: no templates under {args.cdk_out}/<env>/; run `make synth` first", file=sys.stderr)
        return 1
    print("stacks: " + ", ".join(stacks))
    print(format_table(pools))
    return 0
