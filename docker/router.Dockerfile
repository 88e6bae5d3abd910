# syntax=docker/dockerfile:1
# The router image: the `quire` package with the router extra only. No torch, so it stays small
# and starts in about a second.
#   docker build -f docker/router.Dockerfile -t quire/router:0.1.0 .
# Without a daemon (and from a local Debian base and package mirror): scripts/build-images.sh.
#
# BASE_IMAGE: any Debian-family image with python3 (>= 3.11) and its venv module on PATH as
# `python`. The package sources are build arguments too; pip reads them from the environment
# of the RUN steps only, so none of them is left in the image:
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS (local wheels), PIP_CERT (a CA bundle
#   mounted at build time, as scripts/build-images.sh does).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The distribution's sources: pyproject.toml, README.md, the packages (and csrc/); .dockerignore
# leaves out the rest (tests, chart, docs, .git).
COPY . ./
RUN python -m venv /opt/quire \
 && /opt/quire/bin/pip install ".[router]" \
 && /opt/quire/bin/python -c "import router.server" \
 && /opt/quire/bin/quire router --help >/dev/null \
 && ! /opt/quire/bin/python -c "import torch" 2>/dev/null

FROM ${BASE_IMAGE}
# The uid/gid the chart's podSecurityContext runs as (helm/quire/values.yaml).
RUN groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
# The root filesystem may be read-only: the only writable paths are /tmp (HOME) and /cache
# (the tokenizer's cache), emptyDir volumes in the chart, tmpfs in scripts/run-image.py.
ENV PATH=/opt/quire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface
RUN mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
# gRPC, then HTTP (OpenAI API, /metrics, /health).
EXPOSE 50050 8000
ENTRYPOINT ["quire"]
CMD ["router"]
