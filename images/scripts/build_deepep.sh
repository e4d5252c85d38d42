#!/usr/bin/env bash
# DeepEP V1 as a wheel, in one of two variants (images/versions.env DEEPEP_VARIANT):
#   efa-v1    AWS's EFA patch (IBGDA calls -> NVSHMEM host proxy over libfabric), built by AWS's own setup
#             script from awslabs/awsome-distributed-ai at a pinned commit, checked by SHA-256 before it runs;
#             it installs NVSHMEM >= 3.7 (with the libfabric transport) to --nvshmem-prefix.
#   stock-v1  upstream V1 against the NVSHMEM wheel torch depends on (nvidia-nvshmem-cu13); its internode
#             kernels need InfiniBand GPU-initiated RDMA, so on EFA it is intranode only.
# Both build DeepEP at DEEPEP_COMMIT for TORCH_CUDA_ARCH_LIST with the Python on PATH (torch installed).
# Usage: build_deepep.sh --variant efa-v1|stock-v1 --out WHEEL_DIR [--src DEEPEP_TREE] [--nvshmem-prefix DIR]
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

variant="" out="" src="" nvshmem_prefix=/opt/nvshmem
while (($#)); do
    case $1 in
        --variant) variant=${2:?--variant needs a value}; shift 2 ;;
        --out) out=${2:?--out needs a value}; shift 2 ;;
        --src) src=${2:?--src needs a value}; shift 2 ;;
        --nvshmem-prefix) nvshmem_prefix=${2:?--nvshmem-prefix needs a value}; shift 2 ;;
        *) echo "error: unknown argument '$1'; usage: build_deepep.sh --variant efa-v1|stock-v1 --out DIR [--src DIR] [--nvshmem-prefix DIR]" >&2; exit 2 ;;
    esac
done
case $variant in
    efa-v1|stock-v1) ;;
    *) echo "error: --variant '$variant'; allowed: efa-v1, stock-v1" >&2; exit 2 ;;
esac
[[ -n "$out" ]] || { echo "error: --out WHEEL_DIR is required" >&2; exit 2; }
require DEEPEP_COMMIT TORCH_CUDA_ARCH_LIST
cuda=${CUDA_HOME:-/usr/local/cuda}
python=$(command -v python3)
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -n "$src" && -d "$src/.git" ]]; then
    head=$(git -C "$src" rev-parse HEAD)
    [[ "$head" == "$DEEPEP_COMMIT" ]] || { echo "error: $src is at $head, expected DEEPEP_COMMIT $DEEPEP_COMMIT" >&2; exit 1; }
fi

if [[ $variant == efa-v1 ]]; then
    require AWS_DEEPEP_SETUP_COMMIT AWS_DEEPEP_SETUP_SHA256 NVSHMEM_VERSION
    setup="$work/setup_deepep_efa.sh"
    curl -fsSL --retry 3 -o "$setup" "https://raw.githubusercontent.com/awslabs/awsome-distributed-ai/${AWS_DEEPEP_SETUP_COMMIT}/micro-benchmarks/expert-parallelism/deepep-benchmark/setup_deepep_efa.sh"
    echo "${AWS_DEEPEP_SETUP_SHA256}  $setup" | sha256sum --check --strict
    args=(--nvshmem-version "$NVSHMEM_VERSION" --nvshmem-prefix "$nvshmem_prefix" --cuda-home "$cuda"
          --python "$python" --pip "$(command -v pip3)" --wheel-only --wheel-output-dir "$out"
          # The script accepts only the short form of the one commit its patch was written for.
          --deepep-commit "${DEEPEP_COMMIT:0:7}")
    if [[ -n "$src" ]]; then args+=(--deepep-src "$src"); else args+=(--deepep-prefix "$work/DeepEP"); fi
    TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" bash "$setup" "${args[@]}"
else
    if [[ -z "$src" ]]; then
        src="$work/DeepEP"
        git init --quiet "$src"
        git -C "$src" fetch --quiet --depth 1 https://github.com/deepseek-ai/DeepEP.git "$DEEPEP_COMMIT"
        git -C "$src" checkout --quiet FETCH_HEAD
    fi
    # CUDA 13 moved libcu++ (cuda/std/...) under include/cccl; DeepEP's host sources include it.
    CPLUS_INCLUDE_PATH="$cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
        "$python" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$out" "$src"
fi
ls "$out"/deep_ep-*.whl
