"""Each environment is synthesized once per test session, through the CDK CLI, offline and without credentials."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CDK = REPO / "node_modules" / ".bin" / "cdk"
ENVIRONMENTS = tuple(json.loads((REPO / "cdk.json").read_text())["context"]["environments"])
SYNTH_TIMEOUT_S = 240


def offline_env(**extra: str) -> dict[str, str]:
    """The process environment for synthesis: no AWS credentials or config, caches inside the repo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null", AWS_EC2_METADATA_DISABLED="true",
        JSII_RUNTIME_PACKAGE_CACHE_ROOT=str(REPO / ".cache" / "jsii"), CDK_HOME=str(REPO / ".cache" / "cdk"),
        JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION="20", CDK_DISABLE_VERSION_CHECK="1",
        CDK_DISABLE_CLI_TELEMETRY="true", CDK_VALIDATION="false", OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def cdk_out(tmp_path_factory) -> Path:
    """cdk.out/<env>/ for every environment of cdk.json, from `cdk synth -c env=NAME` (both run concurrently)."""
    out = tmp_path_factory.mktemp("cdk.out")
    procs = {name: subprocess.Popen(
        [str(CDK), "synth", "--no-notices", "-q", "-c", f"env={name}", "-o", str(out / name)],
        cwd=REPO, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for name in ENVIRONMENTS}
    failures = []
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=SYNTH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"cdk synth -c env={name} exited {proc.returncode}:\n{output[-4000:]}")
    assert not failures, "\n".join(failures)
    return out


@pytest.fixture(scope="session")
def templates(cdk_out) -> dict[str, dict]:
    """environment -> its stack's CloudFormation template."""
    return {name: json.loads(next((cdk_out / name).glob("*.template.json")).read_text()) for name in ENVIRONMENTS}

