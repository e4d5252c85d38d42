"""Each environment is synthesized once per test session, through the CDK CLI, offline and without credentials."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from infra_helpers import CDK, ENVIRONMENTS, REPO, SYNTH_TIMEOUT_S, offline_env

# In-process synths (test_infra_constructs) start the jsii kernel with this process's environment: no AWS
# credentials, caches in the repo, aws-cdk-lib's built-in validation off (one test turns it on, in a subprocess).
os.environ.update({k: v for k, v in offline_env().items() if k != "PATH"})
for _key in [k for k in os.environ if k.startswith("AWS_") and k not in offline_env()]:
    del os.environ[_key]


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

