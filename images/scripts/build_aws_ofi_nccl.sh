#!/usr/bin/env bash
# aws-ofi-nccl: NCCL's network plugin over libfabric (libnccl-net-ofi.so) and its tuner (libnccl-tuner-ofi.so),
# for the NCCL that torch ships (the plugin carries NCCL's plugin headers; NCCL loads it by name).
# Usage: build_aws_ofi_nccl.sh PREFIX   (needs libfabric from install_efa.sh, CUDA and hwloc headers)
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
require AWS_OFI_NCCL_VERSION AWS_OFI_NCCL_COMMIT
prefix=${1:?usage: build_aws_ofi_nccl.sh PREFIX}
cuda=${CUDA_HOME:-/usr/local/cuda}
libfabric=${LIBFABRIC_HOME:-/opt/amazon/efa}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
clone_at https://github.com/aws/aws-ofi-nccl.git "$AWS_OFI_NCCL_VERSION" "$AWS_OFI_NCCL_COMMIT" "$work/src"
cd "$work/src"
./autogen.sh
# --enable-platform-aws: configure turns the AWS platform (and with it the tuner) on only when it runs on an
# EC2 instance; an image build may run anywhere.
./configure --prefix="$prefix" --with-libfabric="$libfabric" --with-cuda="$cuda" \
    --enable-platform-aws --disable-tests
make -j "$(nproc)"
make install
ls "$prefix"/lib/libnccl-net-ofi.so "$prefix"/lib/libnccl-tuner-ofi.so
