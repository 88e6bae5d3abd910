# syntax=docker/dockerfile:1
# The router image: the `quire` package with the router extra only. No torch, so it stays small
# and starts in about a second.
#   docker build -f docker/router.Dockerfile -t quire/router:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY quire ./quire
COPY quire_cli ./quire_cli
COPY router ./router
COPY engine_worker ./engine_worker
RUN python -m venv /opt/quire \
 && /opt/quire/bin/pip install ".[router]" \
 && /opt/quire/bin/python -c "import router.server" \
 && /opt/quire/bin/quire router --help >/dev/null \
 && ! /opt/quire/bin/python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 quire \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin quire
COPY --from=build /opt/quire /opt/quire
ENV PATH=/opt/quire/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
# gRPC, then HTTP (OpenAI API, /metrics, /health).
EXPOSE 50050 8000
ENTRYPOINT ["quire"]
CMD ["router"]
