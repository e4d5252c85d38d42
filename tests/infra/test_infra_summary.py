"""`moerl synth-summary` reads cdk.out JSON without the CDK."""
from __future__ import annotations

import subprocess
import sys

import pytest
from infra_helpers import REPO

# the session's `cdk synth` of every environment (conftest.cdk_out) runs once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("cdk_out")


def test_synth_summary_lists_stacks_and_pools_with_efa_and_placement(cdk_out):
    result = subprocess.run([sys.executable, "-m", "moe_rl_eks.tools.cli", "synth-summary", str(cdk_out)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "stacks: dev/MoeRl-dev, prod/MoeRl-prod"
    rows = {tuple(line.split()[:3]): line.split() for line in lines[2:]}
    assert rows[("dev", "MoeRl-dev", "trainer")][3:] == ["p5.48xlarge", "ON_DEMAND", "0", "2", "32", "cluster"]
    assert rows[("dev", "MoeRl-dev", "rollout")][3:] == ["g6e.12xlarge", "ON_DEMAND", "0", "2", "0", "-"]
    assert rows[("prod", "MoeRl-prod", "trainer")][3:] == ["p5en.48xlarge", "CAPACITY_BLOCK", "0", "16", "16", "-"]


def test_synth_summary_never_imports_the_cdk(cdk_out):
    code = ("import sys; from moe_rl_eks.infra.summary import main; main([sys.argv[1]]); "
            "import moe_rl_eks.infra; assert 'aws_cdk' not in sys.modules and 'jsii' not in sys.modules, sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(cdk_out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_synth_summary_without_templates_says_what_to_run(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moe_rl_eks.tools.cli", "synth-summary", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "run `make synth` first" in result.stderr
