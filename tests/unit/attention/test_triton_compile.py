"""The Triton attention kernel compiled ahead of time for sm_80 and sm_90, with no GPU.

triton.compile runs the full pipeline to a cubin with the ptxas in the triton wheel, so what
the CPU interpreter cannot see fails here: a tl.dot dimension under 16, shared memory over the
limit, register spills. Runs in a subprocess without TRITON_INTERPRET (the interpreter replaces
@triton.jit functions, which triton.compile cannot take). The full table of variants, with
registers and shared memory: python -m engine_worker.attention.triton_aot
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

REPO = Path(__file__).resolve().parents[3]
# one of each launch shape: prefill tiles with GQA 4:1 and d128 (fp16), decode tiles over
# 256-token blocks (bf16), and IEEE fp32 with head_dim 80 (padded to 128) and no GQA
SCRIPT = """
import json, sys
from dataclasses import asdict
from engine_worker.attention.triton_aot import Variant, compile_variant
variants = [Variant("float16", 32, 8, 128, 16, True), Variant("bfloat16", 9, 3, 64, 256, False),
            Variant("float32", 16, 16, 80, 16, True)]
for arch in (80, 90):
    for v in variants:
        print(json.dumps(asdict(compile_variant(v, arch))), flush=True)
"""


def test_attention_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == 6
    for c in compiled:
        print(c)  # the report: registers and shared memory per variant (pytest -s shows it)
        assert c["spilled_bytes"] == 0, c
        assert 0 < c["registers"] <= 255, c
        assert c["shared_bytes"] <= SHARED_LIMIT_BYTES[c["arch"]], c


OPS_SCRIPT = """
import json
from dataclasses import asdict
from engine_worker.attention.triton_aot import OP_VARIANTS, compile_op
variants = [v for v in OP_VARIANTS if v.dtype == "bfloat16" or v.op == "rope"]
for arch in (80, 90):
    for v in variants:
        print(json.dumps(asdict(compile_op(v, arch))), flush=True)
"""


def test_small_op_kernels_compile_for_sm80_and_sm90():
    """RMSNorm (alone and with the residual add) up to hidden 8192, SiLU-and-mul and RoPE up
    to 32 heads of 128: no spills, within the register file, in every dtype for RoPE."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", OPS_SCRIPT], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert {c["variant"]["op"] for c in compiled} == {"rms_norm", "add_rms_norm",
                                                        "silu_and_mul", "rope"}
    assert len(compiled) == 2 * (3 + 3 + 1 + 2 * 3)
    for c in compiled:
        print(c)
        assert c["spilled_bytes"] == 0, c
        assert 0 < c["registers"] <= 255, c
        assert c["shared_bytes"] <= SHARED_LIMIT_BYTES[c["arch"]], c
