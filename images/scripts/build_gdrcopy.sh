#!/usr/bin/env bash
# GDRCopy's user-space library (NVSHMEM and libfabric use it for low-latency GPU memory copies). Its kernel
# driver, gdrdrv, is the node's: the AL2023 NVIDIA AMI has none, so the GPU nodes build it at first boot from the
# same release (infra/node_pool.py).
# Usage: build_gdrcopy.sh PREFIX
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
require GDRCOPY_VERSION GDRCOPY_COMMIT
prefix=${1:?usage: build_gdrcopy.sh PREFIX}
cuda=${CUDA_HOME:-/usr/local/cuda}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
clone_at https://github.com/NVIDIA/gdrcopy.git "$GDRCOPY_VERSION" "$GDRCOPY_COMMIT" "$work/gdrcopy"
make -C "$work/gdrcopy" -j "$(nproc)" prefix="$prefix" CUDA="$cuda" lib_install
ls "$prefix"/lib/libgdrapi.so*
