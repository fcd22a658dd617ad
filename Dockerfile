# syntax=docker/dockerfile:1
# plm-pipeline for NVIDIA GPUs: `plm train` under DeepSpeed, the Ray data jobs, the MLflow
# server of k8s/tracking. Everything is installed here, at build time; nothing at run time.
#   docker build -t plm-pipeline:0.1.0-cuda .
#   docker run --gpus all --shm-size 16g plm-pipeline:0.1.0-cuda train --help
# The CUDA devel base brings nvcc for DeepSpeed ops built on first use; torch's wheel
# brings its own CUDA runtime, so the base only has to suit the nodes' driver.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3 (3.12 on Ubuntu 24.04), a compiler for DeepSpeed's JIT ops (CPU Adam for offload).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/plm
# Dependencies first (cached while only the code changes); torch==2.13.0 is pinned in
# pyproject.toml: on Linux, PyPI's wheel is the CUDA build.
COPY pyproject.toml README.md ./
# configs/ before the install: the wheel ships it as package data (pipeline/configs links
# to it), so presets and DeepSpeed JSONs are found from any directory.
COPY configs ./configs
COPY pipeline ./pipeline
RUN pip install ".[tracking]"
# As in Dockerfile.cpu: DeepSpeed's C++ ops plm may need, compiled here into the venv's
# extension cache (/opt/venv/var/plm/torch_extensions), so no container compiles them.
# `docker build` sees no GPU, so DeepSpeed's accelerator here is the CPU's: these are the
# CPU accelerator's CPU Adam and shared-memory all-reduce, what the image runs without a
# GPU (the data stage, CPU smoke runs). On a GPU node DeepSpeed's CUDA build of CPU Adam
# (an offloaded optimizer only, zero3-offload.json) is another build: plm compiles it on
# first use, once per venv, and says so.
RUN plm setup
COPY launch ./launch

# A non-root user with a fixed uid (the manifests' runAsUser); Ubuntu's own uid 1000 goes.
# It owns the extension cache: torch takes a lock file there to load an op.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --create-home --shell /bin/bash plm \
    && mkdir -p /data /checkpoints \
    && chown plm:plm /data /checkpoints /opt/plm \
    && chown -R plm:plm /opt/venv/var/plm
ENV HOME=/home/plm
USER 1000:1000

ENTRYPOINT ["plm"]
CMD ["--help"]
