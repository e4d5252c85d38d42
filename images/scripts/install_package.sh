#!/usr/bin/env bash
# This package with EXTRAS into the Python on PATH, every Python dependency held to constraints.txt, then a
# check that each role's entry point imports. torch is installed before (a plain pinned install in the
# Dockerfiles), so the resolver never picks a torch build by itself.
# Usage: install_package.sh [--offline] REPO_ROOT EXTRAS ROLES   e.g. install_package.sh . workloads,kernels trainer,rollout
#   --offline: no index, no dependencies, no build isolation: everything is already installed (a GPU machine
#              with no network).
set -euo pipefail
pip_args=(--no-cache-dir)
if [[ ${1:-} == --offline ]]; then
    pip_args+=(--no-index --no-deps --no-build-isolation)
    shift
fi
root=${1:?usage: install_package.sh [--offline] REPO_ROOT EXTRAS ROLES}
extras=${2:?usage: install_package.sh [--offline] REPO_ROOT EXTRAS ROLES}
roles=${3:?usage: install_package.sh [--offline] REPO_ROOT EXTRAS ROLES}
python=$(command -v python3)

"$python" -m pip install "${pip_args[@]}" -c "$root/constraints.txt" "${root}[${extras}]"
# Import the image's roles' entry points from the installed package (not the source tree), as `moerl doctor`
# does in the running image.
(cd / && "$python" - "$roles" <<'PY'
import importlib
import sys
from moe_rl_eks.tools.cli import SUBCOMMANDS
from moe_rl_eks.core.container import ROLE_COMMANDS
for role in sys.argv[1].split(","):
    command = ROLE_COMMANDS[role]
    module, func, _ = SUBCOMMANDS[command]
    getattr(importlib.import_module(module), func)
    print(f"{role}: moerl {command} -> {module}.{func} imports")
PY
)
