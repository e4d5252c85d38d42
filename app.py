"""CDK app: `cdk synth -c env=NAME` (default dev), or `python app.py [--env NAME]` without the CDK CLI.

It only picks the environment and instantiates the stack; a bad environment fails with the ConfigError message
before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moe_rl_eks.core.environment import load_environments, select_environment
from moe_rl_eks.core.schema import ConfigError

CDK_JSON = Path(__file__).with_name("cdk.json")


def main(argv: list[str]) -> int:
    import aws_cdk as cdk

    from moe_rl_eks.infra import MoeRlStack, add_checks

    parser = argparse.ArgumentParser(description="Synthesize one environment of cdk.json")
    parser.add_argument("--env", default="dev", help="environment name when run directly (default dev)")
    parser.add_argument("--outdir", help="output folder when run directly (default cdk.out/<env>)")
    args = parser.parse_args(argv)
    run_by_cli = "CDK_OUTDIR" in os.environ  # the CLI passes cdk.json's context, -c env=NAME and the outdir
    cli_app = cdk.App() if run_by_cli else None
    name = (cli_app.node.try_get_context("env") or "dev") if cli_app else args.env
    context = cli_app.node.try_get_context("environments") if cli_app else None
    try:
        environments = (load_environments({"environments": context}) if context is not None
                        else load_environments(json.loads(CDK_JSON.read_text())["context"], source=CDK_JSON.name))
        config = select_environment(environments, name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # Run directly, cdk.json is not read for us and App's default outdir is a temporary folder; App creates its
    # outdir at once, so only after the environment is known to be valid.
    app = cli_app or cdk.App(outdir=args.outdir or f"cdk.out/{name}")
    add_checks(app)
    MoeRlStack(app, f"MoeRl-{name}", config=config)
    app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
