#!/usr/bin/env bash
# The image build scripts outside Docker, on a GPU machine with no network (the lent H200): DeepEP stock V1
# built by images/scripts/build_deepep.sh from a source tree at DEEPEP_COMMIT, this package installed by
# images/scripts/install_package.sh --offline, then `moerl doctor` for the trainer and rollout roles.
# Usage: images/h200_check.sh DEEPEP_TREE LOG      (run from the repository root)
set -uo pipefail
tree=${1:?usage: h200_check.sh DEEPEP_TREE LOG}
log=${2:?usage: h200_check.sh DEEPEP_TREE LOG}
# The pinned commit from versions.env; only Hopper here (the image builds versions.env's TORCH_CUDA_ARCH_LIST).
DEEPEP_COMMIT=$(sed -n 's/^DEEPEP_COMMIT=//p' images/versions.env)
export DEEPEP_COMMIT TORCH_CUDA_ARCH_LIST=9.0
wheels=$(mktemp -d)
{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "nvshmem wheel", m.version("nvidia-nvshmem-cu13"), "setuptools", m.version("setuptools"))'
    echo "== build_deepep.sh --variant stock-v1"
    start=$SECONDS
    timeout 150 images/scripts/build_deepep.sh --variant stock-v1 --src "$tree" --out "$wheels" 2>&1 | tail -n 15
    echo "build_deepep.sh exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
    python3 -m pip install -q --no-deps --no-index "$wheels"/deep_ep-*.whl && echo "deep_ep wheel installed"
    echo "== install_package.sh --offline"
    images/scripts/install_package.sh --offline . workloads,kernels trainer,rollout 2>&1 | tail -n 5
    echo "== moerl doctor --role trainer --efa no (stock-v1)"
    MOERL_DEEPEP_VARIANT=stock-v1 python3 -m moe_rl_eks.tools.cli doctor --role trainer --efa no
    echo "doctor exit $?"
    echo "== moerl doctor --role trainer --efa (no EFA here: blockers expected)"
    MOERL_DEEPEP_VARIANT=stock-v1 python3 -m moe_rl_eks.tools.cli doctor --role trainer --efa
    echo "doctor exit $?"
    echo "== moerl doctor --role rollout --efa no"
    MOERL_DEEPEP_VARIANT=none python3 -m moe_rl_eks.tools.cli doctor --role rollout --efa no
    echo "doctor exit $?"
} 2>&1 | tee "$log"
