# Sourced by the one-H200 scripts (h200-*.sh): the whole call's time budget and a step runner. Set BUDGET (seconds
# for the script, under the device tool's per-call limit) before sourcing; each step's exit status and seconds go to
# $OUT/steps.txt, so a call that ran out of time still says which steps finished; package_env sets up the package;
# build_deepep builds DeepEP from the carried source.
# shellcheck shell=bash
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
step() {  # step NAME LIMIT COMMAND...: run under a time limit, record rc and seconds; skipped under 15 s
    local name=$1 limit=$2 t=$SECONDS
    shift 2
    if [ "$limit" -lt 15 ]; then echo "$name: skipped, $limit s left" | tee -a "$OUT/steps.txt"; return; fi
    timeout --kill-after=5 "$limit" "$@"
    echo "$name: rc $? after $((SECONDS - t)) s (limit $limit)" | tee -a "$OUT/steps.txt"
}
package_env() {  # the package from a shim on PYTHONPATH, the carried wheels (.whl/), the device's NCCL rules
    mkdir -p /tmp/shim/moe_rl_eks
    for p in core infra k8s workloads kernels tools; do ln -sfn "$PWD/$p" /tmp/shim/moe_rl_eks/$p; done
    if [ -d .whl ]; then python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1; fi
    export PYTHONPATH=/tmp/site:/tmp/shim PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
    restore_kernel_cache
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device's rule (KINDS.md)
}
# A previous call's compiled kernels, and its autotuning choices where it set TRITON_CACHE_AUTOTUNING=1 (its
# $OUT/triton-cache.tgz, copied here and carried: carry [".whl", ".kernel-cache"]): a process's first steps then
# skip 45-75 s of compilation and tuning.
KERNEL_CACHE=.kernel-cache/triton.tgz
restore_kernel_cache() {
    [ -f "$KERNEL_CACHE" ] || return 0
    mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$KERNEL_CACHE" -C "$TRITON_CACHE_DIR" &&
        echo "kernel cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from $KERNEL_CACHE"
}
save_kernel_cache() {  # $OUT/triton-cache.tgz, unless over the 16 MiB a file coming back may have
    tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null || return 0
    local size
    size=$(stat -c %s "$OUT/triton-cache.tgz")
    if [ "$size" -gt $((16 << 20)) ]; then
        rm -f "$OUT/triton-cache.tgz"
        echo "kernel cache: $((size >> 20)) MiB compressed, over the 16 MiB a returned file may have; not returned"
    else
        echo "kernel cache: $((size >> 10)) KiB in triton-cache.tgz (copy it to $KERNEL_CACHE and carry .kernel-cache)"
    fi
}
build_deepep() {  # DeepEP V1 stock from the carried .fetched/DeepEP into /tmp/deepep (MAX_JOBS: compile jobs, 16)
    rm -rf /tmp/deepep-wheel && mkdir -p /tmp/deepep-wheel &&
    DEEPEP_COMMIT=$(sed -n 's/^DEEPEP_COMMIT=//p' images/versions.env) TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} \
        images/scripts/build_deepep.sh --variant stock-v1 --src .fetched/DeepEP --out /tmp/deepep-wheel &&
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/deepep /tmp/deepep-wheel/deep_ep-*.whl &&
    python3 -c 'import deep_ep; print("deep_ep", deep_ep.__file__)'
}
export -f build_deepep  # steps run it as `bash -c build_deepep` under timeout
