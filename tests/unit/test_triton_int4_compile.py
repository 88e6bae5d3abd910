"""The Triton 4-bit linear kernel compiled ahead of time for sm_80 and sm_90, with no GPU
(as tests/unit/attention/test_triton_compile.py does for attention): what the interpreter
cannot see fails here (a tl.dot dimension under 16, shared memory over the limit, register
spills). In a subprocess without TRITON_INTERPRET. The full table:
python -m engine_worker.backends.triton_int4_aot
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine_worker.attention.triton_aot import SHARED_LIMIT_BYTES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# decode tiles in fp16 (group 128), 64-row tiles in bf16 (group 32) and IEEE fp32, and the
# de-quantize kernel many rows take
SCRIPT = """
import json
from dataclasses import asdict
from engine_worker.backends.triton_int4_aot import Int4Variant, compile_variant
variants = [Int4Variant("float16", 128, 1), Int4Variant("bfloat16", 32, 24),
            Int4Variant("float32", 128, 24), Int4Variant("float16", 128, 256)]
for arch in (80, 90):
    for v in variants:
        print(json.dumps(asdict(compile_variant(v, arch))), flush=True)
"""


def test_int4_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == 8
    for c in compiled:
        print(c)  # registers and shared memory per variant (pytest -s shows it)
        assert c["spilled_bytes"] == 0, c
        assert 0 < c["registers"] <= 255, c
        assert c["shared_bytes"] <= SHARED_LIMIT_BYTES[c["arch"]], c
