"""The AVX2 + FMA kernel set (csrc/cpu/avx2, ``torch.ops.quire_avx2``) against its PyTorch
references.

The set builds with explicit ``-mavx2 -mfma -mf16c`` flags, so it runs on any x86 CPU with
those (AVX-512 machines included); elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import random
import tempfile
from pathlib import Path

import pytest
import torch

from engine_worker.attention import TorchAttentionBackend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rope
from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.runner import RunnerRequestState

AVX2_DIR = Path(__file__).resolve().parents[3] / "csrc" / "cpu" / "avx2"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17", "-DQUIRE_NS=quire_avx2"]


@functools.cache
def _avx2_unavailable_reason() -> str | None:
    """Builds the set into a private directory named by its sources' digest; None once
    ``torch.ops.quire_avx2`` holds it."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not all(f" {f}" in flags for f in ("avx2", "fma", "f16c")):
        return "the CPU lacks AVX2, FMA or F16C"
    sources = sorted(AVX2_DIR.glob("*.cpp"))
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(AVX2_DIR.iterdir()):
        digest.update(path.read_bytes())
    build_dir = Path(tempfile.gettempdir()) / f"quire-avx2-test-{digest.hexdigest()[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load

        load(name="quire_avx2_test", sources=[str(s) for s in sources], extra_cflags=CFLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    except Exception as exc:  # no compiler: skip, saying why
        return f"building csrc/cpu/avx2 failed: {str(exc).strip().splitlines()[-1][:300]}"
    return None


pytestmark = pytest.mark.skipif(_avx2_unavailable_reason() is not None,
                                reason=f"AVX2 kernels: {_avx2_unavailable_reason()}")
ops = torch.ops.quire_avx2

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype):
    # one bf16 / fp16 rounding step apart at most (the kernels round intermediates where the
    # references do, but sum in another order)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [576, 2056])
def test_rms_norm_matches_reference(dtype, rows, hidden):
    torch.manual_seed(rows)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    weight = (1 + torch.randn(hidden) / 4).to(dtype)
    _close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), dtype)


def test_rms_norm_reads_strided_rows():
    x = torch.randn(5, 2 * 576)[:, :576]  # rows of a wider tensor
    weight = torch.randn(576)
    _close(ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_silu_and_mul_matches_reference(dtype, rows):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0]).to(dtype)  # exp's clamped range
    _close(ops.silu_and_mul(x), silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_reference_in_place(dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(head_dim=64, theta=10000.0, max_position_embeddings=2048),
                           2048, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 77, 1023, 2047, 3])
    # q and k as the model has them: views into one fused QKV row per token
    qkv = torch.randn(len(positions), (9 + 3 + 3) * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    want_q, want_k = apply_rope(positions, q, k, rope.cos, rope.sin)
    untouched_v = qkv[:, 12 * 64:].clone()
    ops.rotary_embedding(q, k, positions, rope.cos, rope.sin)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(qkv[:, 12 * 64:], untouched_v)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary_embedding(q, k, torch.tensor([2048] * len(positions)), rope.cos, rope.sin)
