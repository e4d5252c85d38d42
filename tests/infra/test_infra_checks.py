"""Policy checks on every synthesized template (cdk-nag, our EKS guardrails, cfn-lint, checkov) and the app's
behaviour on good and bad environments."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra_helpers import ENVIRONMENTS, REPO, offline_env
from moe_rl_eks.infra.checks import cluster_violations

# the session's `cdk synth` of every environment (conftest.cdk_out) runs once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("cdk_out")

CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"
SKIPS = yaml.safe_load((Path(__file__).parent / "checkov_skips.yaml").read_text())
TOOL_TIMEOUT_S = 240


def test_every_environment_synthesizes_nag_clean_through_the_cli(cdk_out):
    # The session synth ran cdk-nag (AwsSolutions) and our guardrails as validation plugins; any unacknowledged
    # finding would have failed it. Here: each acknowledgment names a specific finding and carries a reason.
    for name in ENVIRONMENTS:
        metadata = json.loads(next((cdk_out / name).glob("*.metadata.json")).read_text())
        acks = {rule: reason for entries in metadata.values() for e in entries
                if e["type"] == "aws:cdk:acknowledged-rules" for rule, reason in e["data"].items()
                if "AwsSolutions" in rule}
        assert acks, name
        for rule, reason in acks.items():
            assert re.fullmatch(r"AwsSolutions::AwsSolutions-[A-Z]+\d+(\[.+\])?", rule), rule
            if re.match(r"AwsSolutions::AwsSolutions-IAM[45]", rule):
                assert "[" in rule, f"{rule}: IAM acknowledgments must name the finding"
            assert len(reason) >= 40, (rule, reason)


def test_synth_needs_no_context_lookups(cdk_out):
    # A lookup (AZs, VPC, AMI) would be listed as missing context and need credentials to resolve.
    for name in ENVIRONMENTS:
        manifest = json.loads((cdk_out / name / "manifest.json").read_text())
        assert "missing" not in manifest, manifest.get("missing")
    assert not (REPO / "cdk.context.json").exists()


@pytest.mark.parametrize("mutate,rule", [
    (lambda c: c["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=[]), "MoeRl-EKS-PublicEndpoint"),
    (lambda c: c["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=["0.0.0.0/0"]), "MoeRl-EKS-PublicEndpoint"),
    # a string split into characters, or no CIDR at all, is no allow-list (and must not crash the plugin)
    (lambda c: c["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=list("10.0.0.0/8")),
     "MoeRl-EKS-PublicEndpoint"),
    (lambda c: c["Logging"]["ClusterLogging"]["EnabledTypes"].pop(), "MoeRl-EKS-ControlPlaneLogs"),
    (lambda c: c.pop("Logging"), "MoeRl-EKS-ControlPlaneLogs"),
])
def test_guardrails_flag_public_endpoint_without_allow_list_and_disabled_log_types(templates, mutate, rule):
    assert cluster_violations(templates["prod"]) == []
    bad = copy.deepcopy(templates["prod"])
    cluster = next(r for r in bad["Resources"].values() if r["Type"] == "AWS::EKS::Cluster")["Properties"]
    mutate(cluster)
    assert [v[0] for v in cluster_violations(bad)] == [rule]


def test_guardrails_accept_a_public_endpoint_with_an_allow_list(templates):
    ok = copy.deepcopy(templates["dev"])
    cluster = next(r for r in ok["Resources"].values() if r["Type"] == "AWS::EKS::Cluster")["Properties"]
    cluster["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=["203.0.113.0/24"])
    assert cluster_violations(ok) == []


def test_cfn_lint_reports_no_errors_on_any_template(cdk_out):
    paths = [str(p) for p in sorted(cdk_out.glob("*/*.template.json"))]
    assert len(paths) == len(ENVIRONMENTS)
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    result = subprocess.run([str(cfn_lint), "--non-zero-exit-code", "error", *paths],
                            capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def _skipped(check_id: str, resource: str) -> bool:
    logical_id = resource.split(".", 1)[-1]
    return any(s["check"] == check_id and any(logical_id.startswith(p) for p in s["resources"]) for s in SKIPS)


def test_checkov_fails_nothing_outside_the_committed_skip_list(cdk_out):
    assert CHECKOV.exists(), "run `make bootstrap` (creates .venv-checkov with the pinned checkov)"
    assert all(s["reason"].strip() for s in SKIPS)
    paths = sorted(cdk_out.glob("*/*.template.json"))
    args = [str(CHECKOV), "--framework", "cloudformation", "--skip-download", "--quiet", "-o", "json"]
    for p in paths:
        args += ["-f", str(p)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=offline_env())
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"]["failed_checks"]]
    assert failed, "checkov found nothing to skip: the skip list is stale"
    unexpected = [f for f in failed if not _skipped(f[0], f[1])]
    assert not unexpected, unexpected
    used = {(s["check"]) for s in SKIPS}
    assert used == {f[0] for f in failed}, "every skip-list entry must still be needed"


def test_python_app_synthesizes_with_builtin_validation_and_checks(tmp_path):
    # The one synth with aws-cdk-lib's built-in CloudFormation validation on, run as `python app.py`.
    out = tmp_path / "dev"
    env = offline_env()
    env.pop("CDK_VALIDATION")
    result = subprocess.run([sys.executable, "app.py", "--env", "dev", "--outdir", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    template = json.loads((out / "MoeRl-dev.template.json").read_text())
    assert any(r["Type"] == "AWS::EKS::Cluster" for r in template["Resources"].values())


def test_unknown_environment_fails_with_the_config_error_and_writes_nothing(tmp_path):
    out = tmp_path / "nope"
    result = subprocess.run([sys.executable, "app.py", "--env", "staging", "--outdir", str(out)], cwd=REPO,
                            env=offline_env(), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert result.returncode == 1
    assert "cdk.json: env: 'staging' is not allowed; known environments: dev, prod" in result.stderr
    assert not out.exists()
