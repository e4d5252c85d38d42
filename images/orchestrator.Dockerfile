# syntax=docker/dockerfile:1.7
# The orchestrator image, from the repository root: CPU only and small (it lands on the system nodes). torch
# is the CPU wheel from PyTorch's index, pinned to the same version as the GPU images. `make images` passes
# every version from images/versions.env as a build argument. UID 10001, read-only root filesystem (writes go
# under /tmp). No HEALTHCHECK: Kubernetes ignores it; `moerl doctor --role orchestrator` runs instead.

ARG PYTHON_IMAGE

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY constraints.txt /build/src/constraints.txt
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}+cpu"
COPY images/scripts/ /build/scripts/
COPY pyproject.toml README.md /build/src/
COPY core/ /build/src/core/
COPY infra/ /build/src/infra/
COPY k8s/ /build/src/k8s/
COPY workloads/ /build/src/workloads/
COPY kernels/ /build/src/kernels/
COPY tools/ /build/src/tools/
RUN /build/scripts/install_package.sh /build/src workloads orchestrator

FROM ${PYTHON_IMAGE} AS orchestrator
COPY --from=build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/tmp"]
USER 10001:10001
WORKDIR /tmp
CMD ["moerl", "doctor", "--role", "orchestrator"]
