#!/usr/bin/env bash
# One lent-GPU run, in one call (device time is short): the setup, `tests/gpu`, then the CUDA
# benchmarks on a random-weight model of SmolLM2's shape. Run from the repository root on the
# device machine with `.whl` and `.gpu` carried (scripts/gpu-lease-wheels.sh makes `.whl`; `.gpu/tok`
# holds the converted embedded model's config and tokenizer files, no weights). Everything it
# writes goes under $OUT. Each part has its own time limit so a hang in one still returns the rest.
set -uo pipefail
out="${OUT:?OUT names the folder whose files come back}"
export PYTHONUNBUFFERED=1
bash scripts/gpu-lease-setup.sh 2>&1 | tail -3 || exit 1
export PYTHONPATH="$PWD:/tmp/site" QUIRE_CACHE_DIR=/tmp/qc
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null; } | tee "$out/machine.txt"
timeout "${GPU_TESTS_S:-300}" python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 \
    | tee "$out/tests.log" | tail -15
bench() { local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m quire_cli bench "$@" --model /tmp/smol --device cuda \
      --dtype bfloat16 > "$out/$name.log" 2>&1; echo "bench $name: exit $?"; tail -4 "$out/$name.log"; }
bench latency 90 latency --repeats 3 --output-json "$out/latency.json"
bench throughput 240 throughput --output-json "$out/throughput.json" \
    --output-plot "$out/throughput.png"
