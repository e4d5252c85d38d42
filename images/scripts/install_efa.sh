#!/usr/bin/env bash
# EFA user space (libfabric with the efa provider, rdma-core) from AWS's EFA installer at EFA_INSTALLER_VERSION.
# Usage: install_efa.sh   (as root; Debian/Ubuntu or Amazon Linux)
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
require EFA_INSTALLER_VERSION

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The installer installs its dependencies through the distribution's package manager; the images drop apt's
# lists after each install, so fetch them again first (and drop them again at the end).
if command -v apt-get >/dev/null; then apt-get update; fi
curl -fsSL --retry 3 -o "$work/efa.tar.gz" \
    "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
tar -xzf "$work/efa.tar.gz" -C "$work"
# --skip-kmod: the node's AMI carries the kernel module; --skip-limit-conf: limits come from the container
# runtime, not /etc/security; --no-verify: no EFA device exists at build time. --disable-ngc: from 1.48 the
# installer takes an nvidia/cuda base (it has /opt/nvidia/nvidia_entrypoint.sh) for an NGC container and
# changes what it installs; this image is not one.
(cd "$work/aws-efa-installer" && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify --disable-ngc)
# The installer brings its own aws-ofi-nccl build; ours (build_aws_ofi_nccl.sh) is built against torch's NCCL
# with the tuner. Two plugins on the loader path would leave the choice to search order.
rm -rf /opt/amazon/ofi-nccl /var/lib/apt/lists/*
ldconfig
/opt/amazon/efa/bin/fi_info --version
