"""`moerl manifests`: a run file + a cdk.json environment (+ the stack outputs) -> dist/<env>/<run>/*.k8s.yaml.

Every check runs before anything is written; the manifests are synthesized into a temporary directory beside
the target and moved into place at the end, so a failed run leaves the previous manifests as they were.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path


from moe_rl_eks.core import cluster
from moe_rl_eks.core.environment import load_cdk_json, select_environment
from moe_rl_eks.core.run import ResolvedRun, load_run, resolve_run
from moe_rl_eks.core.schema import ConfigError

from .outputs import StackOutputs, check_run_storage, load_outputs

# Object names derive from the run name (the longest: JobSet pod host names `<run>-nccl-check-node-0-<i>`,
# at most 63 characters).
RUN_NAME = re.compile(r"[a-z]([-a-z0-9]{0,28}[a-z0-9])?")


def build(run_path: Path, env_name: str | None, outputs_path: Path | None, cdk_json: Path, out_dir: Path) -> Path:
    """Check everything, then write the manifests; returns the directory written. Raises ConfigError."""
    source = str(run_path)
    for path, what in ((run_path, "run file"), (cdk_json, "cdk.json")):
        if not path.is_file():
            raise ConfigError(str(path), "", None, f"{what} not found")
    run = load_run(run_path)
    if not RUN_NAME.fullmatch(run.name):
        raise ConfigError(source, "name", run.name, "a cluster run's name is a lowercase DNS label of at most "
                          "30 characters (it prefixes every object name)")
    if run.environment is None:
        raise ConfigError(source, "environment", None, "this run declares no environment (a local run): there is "
                          "no cluster to write manifests for")
    env_name = env_name or run.environment
    if env_name != run.environment:
        raise ConfigError(source, "environment", run.environment, f"--env is {env_name!r}; a run is checked against "
                          "the environment it declares")
    envs = load_cdk_json(cdk_json)
    env = select_environment(envs, env_name)
    resolved = resolve_run(run, env, source=source)
    if outputs_path is None:
        raise ConfigError(source, "--outputs", None, "required: the ECR repositories and the Prometheus endpoint "
                          "exist only after `cdk deploy`; pass its --outputs-file (the tests use "
                          "tests/k8s/data/outputs.example.json)")
    outputs = load_outputs(outputs_path, env)
    if run.rollout.autoscaled and outputs.prometheus_endpoint is None:
        raise ConfigError(str(outputs_path), f"{outputs.stack}.{cluster.OUTPUT_PROMETHEUS_ENDPOINT}", None,
                          "the rollout autoscaler reads the queue depth from Amazon Managed Prometheus")
    check_run_storage(run, outputs, source)
    return _write(resolved, outputs, source, out_dir / env_name / run.name)


def _write(resolved: ResolvedRun, outputs: StackOutputs, source: str, target: Path) -> Path:
    import cdk8s  # the slow imports (a Node process): only once every check has passed

    from .run_chart import RunChart
    from .validation import ValidationChart

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        app = cdk8s.App(outdir=str(staging), output_file_extension=".k8s.yaml",
                        yaml_output_type=cdk8s.YamlOutputType.FILE_PER_CHART)
        RunChart(app, "run", resolved=resolved, outputs=outputs, source=source)
        ValidationChart(app, "validation", resolved=resolved, outputs=outputs)
        app.synth()
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(staging, target)
            shutil.rmtree(old)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl manifests", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, type=Path, help="run file, e.g. configs/runs/qwen3-30b-a3b-p5.yaml")
    parser.add_argument("--env", help="cdk.json environment (default: the one the run declares)")
    parser.add_argument("--outputs", type=Path, help="`cdk deploy --outputs-file` JSON of that environment's stack")
    parser.add_argument("--out", type=Path, default=Path("dist"), help="output root (default: dist)")
    parser.add_argument("--cdk-json", type=Path, default=Path("cdk.json"))
    args = parser.parse_args(argv)
    try:
        target = build(args.run, args.env, args.outputs, args.cdk_json, args.out)
    except ConfigError as exc:
        print(f"moerl manifests: {exc}", file=sys.stderr)
        print("moerl manifests: nothing written", file=sys.stderr)
        return 2
    print(f"moerl manifests: wrote {', '.join(sorted(p.name for p in target.iterdir()))} to {target}")
    return 0
