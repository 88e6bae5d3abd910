#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it reaches no registry; its image has torch, triton,
# transformers, peft, grpcio, protobuf and numpy for Python 3.12), fetched here into .whl/ for
# scripts/gpu-lease-setup.sh to install there. Versions follow this checkout's .venv where it
# pins them (grpcio, protobuf, apache-tvm-ffi: the stubs and xgrammar's binding need them).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=.venv/bin/pip
version() { "$pip" show "$1" | awk '/^Version/{print $2}'; }
mkdir -p .whl
"$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .whl \
  "grpcio==$(version grpcio)" "protobuf==$(version protobuf)" \
  "apache-tvm-ffi==$(version apache-tvm-ffi)" grpcio-health-checking grpcio-reflection gguf \
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
  opentelemetry-exporter-otlp-proto-http opentelemetry-proto \
  opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-common pyzmq xgrammar \
  pydantic pydantic-core annotated-types typing-inspection importlib-metadata \
  googleapis-common-protos
ls .whl
