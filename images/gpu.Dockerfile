# syntax=docker/dockerfile:1.7
# The GPU images, from the repository root: `make images` (images/build.py) builds the `rollout` and `trainer`
# targets with every version from images/versions.env as a build argument (none has a default here).
#   build    CUDA devel: compiles GDRCopy, aws-ofi-nccl and DeepEP, installs torch and this package.
#   gpu      CUDA runtime, no compiler toolchain besides the C compiler triton needs for its launchers: EFA user
#            space, aws-ofi-nccl + tuner, GDRCopy, torch, this package [workloads,kernels], DeepEP (the variant
#            recorded in MOERL_DEEPEP_VARIANT) and NVSHMEM.
#   rollout  gpu, starting the rollout role's doctor: a server sharded over GPUs decodes over DeepEP's
#            low-latency kernels (workloads/moe/deepep_ll.py), so it needs DeepEP as the trainer does.
#   trainer  gpu, starting the trainer role's doctor.
# Both run as UID 10001 on a read-only root filesystem: everything that writes goes under /tmp (the pod's
# emptyDir), as k8s/pods.py mounts it. No HEALTHCHECK: Kubernetes ignores it; `moerl doctor` runs instead.

ARG CUDA_DEVEL_IMAGE
ARG CUDA_RUNTIME_IMAGE

FROM ${CUDA_DEVEL_IMAGE} AS build
ARG EFA_INSTALLER_VERSION
ARG AWS_OFI_NCCL_VERSION
ARG AWS_OFI_NCCL_COMMIT
ARG GDRCOPY_VERSION
ARG GDRCOPY_COMMIT
ARG TORCH_VERSION
ARG NINJA_VERSION
ARG SETUPTOOLS_VERSION
ARG WHEEL_VERSION
ARG DEEPEP_VARIANT
ARG DEEPEP_COMMIT
ARG AWS_DEEPEP_SETUP_COMMIT
ARG AWS_DEEPEP_SETUP_SHA256
ARG NVSHMEM_VERSION
ARG TORCH_CUDA_ARCH_LIST
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Distribution packages are not pinned one by one (DL3008): Ubuntu's archive keeps only the current build of a
# package, so exact pins break within weeks; the base image itself is pinned by digest (base-images.lock).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        autoconf automake build-essential ca-certificates curl git libhwloc-dev libtool ninja-build pkg-config \
        python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY images/scripts/ /build/scripts/
# One layer per compiled dependency on purpose: a version bump rebuilds that layer and the ones after it only.
# hadolint ignore=DL3059
RUN /build/scripts/install_efa.sh
# Its own layer (see above).
# hadolint ignore=DL3059
RUN /build/scripts/build_gdrcopy.sh /opt/gdrcopy
# Its own layer (see above).
# hadolint ignore=DL3059
RUN /build/scripts/build_aws_ofi_nccl.sh /opt/aws-ofi-nccl
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY constraints.txt /build/src/constraints.txt
# torch first, by exact version, so nothing later resolves another build of it (its CUDA 13.0 wheel pins its
# nvidia-* libraries, NCCL included, exactly).
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir -c /build/src/constraints.txt "torch==${TORCH_VERSION}" \
        "ninja==${NINJA_VERSION}" "setuptools==${SETUPTOOLS_VERSION}" "wheel==${WHEEL_VERSION}"
# /opt/nvshmem stays empty for stock-v1 (it links torch's NVSHMEM wheel).
RUN mkdir -p /opt/nvshmem \
    && /build/scripts/build_deepep.sh --variant "${DEEPEP_VARIANT}" --out /opt/wheels --nvshmem-prefix /opt/nvshmem
COPY pyproject.toml README.md /build/src/
COPY core/ /build/src/core/
COPY infra/ /build/src/infra/
COPY k8s/ /build/src/k8s/
COPY workloads/ /build/src/workloads/
COPY kernels/ /build/src/kernels/
COPY tools/ /build/src/tools/
RUN /build/scripts/install_package.sh /build/src workloads,kernels trainer,rollout

FROM ${CUDA_RUNTIME_IMAGE} AS gpu
ARG EFA_INSTALLER_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# gcc: triton compiles its small C launchers at first use. curl only for the EFA installer, removed after.
# Not pinned one by one: see the build stage (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates curl gcc libc6-dev libhwloc15 python3 python3-dev \
    && rm -rf /var/lib/apt/lists/*
COPY images/scripts/common.sh images/scripts/install_efa.sh /build/scripts/
RUN /build/scripts/install_efa.sh \
    && rm -rf /build \
    && apt-get purge -y curl && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/gdrcopy /opt/gdrcopy
COPY --from=build /opt/aws-ofi-nccl /opt/aws-ofi-nccl
COPY --from=build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/opt/amazon/efa/bin:$PATH \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HOME=/tmp/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
ARG DEEPEP_VARIANT
ARG NVSHMEM_REMOTE_TRANSPORT
COPY --from=build /opt/wheels /opt/wheels
COPY --from=build /opt/nvshmem /opt/nvshmem
# efa-v1 links NVSHMEM 3.7 from /opt/nvshmem; torch's own NVSHMEM wheel (3.4.5, same soname) would be loaded
# first in the same process, so it goes (AWS's DeepEP image does the same).
RUN pip install --no-cache-dir --no-deps /opt/wheels/deep_ep-*.whl \
    && if [ "${DEEPEP_VARIANT}" = efa-v1 ]; then pip uninstall -y nvidia-nvshmem-cu13; fi \
    && rm -rf /opt/wheels
# NCCL finds the plugin and tuner by name on the loader path; the EFA pods' manifests (k8s/collectives.py) set
# FI_PROVIDER=efa and NCCL_NET_PLUGIN/NCCL_TUNER_PLUGIN=ofi, so a pod without EFA does not look for it.
ENV LD_LIBRARY_PATH=/opt/nvshmem/lib:/opt/aws-ofi-nccl/lib:/opt/amazon/efa/lib:/opt/gdrcopy/lib:/usr/local/cuda/lib64 \
    MOERL_DEEPEP_VARIANT=${DEEPEP_VARIANT} \
    NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT} \
    NVSHMEM_LIBFABRIC_PROVIDER=efa
VOLUME ["/tmp"]
WORKDIR /tmp

FROM gpu AS rollout
USER 10001:10001
CMD ["moerl", "doctor", "--role", "rollout"]

FROM gpu AS trainer
USER 10001:10001
CMD ["moerl", "doctor", "--role", "trainer"]
