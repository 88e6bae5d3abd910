"""The Triton kernels of the layer's small ops (engine_worker/backends/triton_ops.py) against
their references, under Triton's CPU interpreter here (tests/conftest.py), on the GPU in
tests/gpu/test_triton_ops_cuda.py: RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE in
place; and the triton backend's fused Llama stack against the per-layer reference path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine_worker.backends import triton_ops  # noqa: E402
from engine_worker.layers.activation import silu_and_mul  # noqa: E402
from engine_worker.layers.norm import rms_norm  # noqa: E402
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rope  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """A couple of units in the last place of the dtype (the interpreter rounds bf16 its own
    way; the kernels' fp32 sums differ from torch's in order)."""
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}[dtype]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (3, 4096), (5, 80)])
def test_rms_norm_matches_reference(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=hidden)
    weight = _randn(hidden, dtype=dtype, seed=1)
    got = triton_ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), rms_norm(x, weight, 1e-5).float(), **tolerance(dtype))


def test_rms_norm_reads_strided_rows_and_leaves_its_input():
    base = _randn(5, 200, dtype=torch.float32, seed=3)
    x = base[:, 8:72]  # rows 200 apart
    before = base.clone()
    weight = _randn(64, dtype=torch.float32, seed=4)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(base, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (9, 576), (2, 4096)])
def test_fused_add_rms_norm_updates_the_residual_and_norms_the_sum(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=hidden + 1)
    residual = _randn(rows, hidden, dtype=dtype, seed=hidden + 2)
    weight = _randn(hidden, dtype=dtype, seed=5)
    want_residual = residual + x
    want = rms_norm(want_residual, weight, 1e-6)
    x_before = x.clone()
    got = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual.float(), want_residual.float(), **tolerance(dtype))
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 1536), (3, 1100), (2, 4096)])
def test_silu_and_mul_matches_reference(dtype, rows, width):
    gate_up = _randn(rows, 2 * width, dtype=dtype, seed=width) * 3
    got = triton_ops.silu_and_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype
    torch.testing.assert_close(got.float(), silu_and_mul(gate_up).float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (3, 1, 80)])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rope_rotates_q_and_k_in_place_as_the_reference(dtype, heads, kv_heads, head_dim,
                                                        num_tokens):
    """q and k are views into one fused QKV output, as the model hands them: rotated in
    place, v untouched."""
    rotary = RotaryEmbedding(RopeConfig(head_dim, 10000.0, 4096), 4096, torch.device("cpu"))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=head_dim + num_tokens)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)
    v_before = v.clone()
    positions = torch.tensor([0, 4095, 17, 1, 1, 300, 2048][:num_tokens])
    want_q, want_k = apply_rope(positions, q.float(), k.float(), rotary.cos, rotary.sin)
    got_q, got_k = triton_ops.rope(positions, q, k, rotary.cos, rotary.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q.float(), want_q, **tolerance(dtype))
    torch.testing.assert_close(k.float(), want_k, **tolerance(dtype))
    assert torch.equal(v, v_before)


def test_empty_steps_launch_nothing():
    weight = torch.ones(64)
    assert triton_ops.rms_norm(torch.empty(0, 64), weight, 1e-6).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    q, k = torch.empty(0, 2, 64), torch.empty(0, 1, 64)
    cos = torch.ones(8, 64)
    assert triton_ops.rope(torch.empty(0, dtype=torch.long), q, k, cos, cos)[0].shape == q.shape


def test_the_fused_llama_stack_matches_the_reference_layers(tiny_model_dir):
    """The triton backend runs a loaded Llama's layers as one stack (residual adds folded into
    the norms), graph-ready; its hidden states and K/V writes equal the torch backend's
    per-layer path on a step of two prefills and a decode."""
    from engine_worker.backends import BACKENDS
    from engine_worker.backends.triton import TritonLlamaLayers
    from engine_worker.model_runner.inputs import build_step_inputs
    from engine_worker.model_runner.runner import RunnerRequestState
    from engine_worker.weights.loader import load_model

    cpu = torch.device("cpu")
    models = {name: load_model(tiny_model_dir, dtype=torch.float32, device=cpu,
                               backend=BACKENDS[name].resolve(cpu), max_model_len=128).model
              for name in ("triton", "torch")}
    stack = models["triton"].layer_stack
    assert isinstance(stack, TritonLlamaLayers) and stack.graph_ready
    assert models["torch"].layer_stack is None
    states = [RunnerRequestState(req_id=str(i), token_ids=tokens, num_prompt_tokens=len(tokens),
                                 params=None, block_ids=blocks, num_computed_tokens=computed,
                                 generator=None)
              for i, (tokens, blocks, computed) in enumerate(
                  [(list(range(3, 24)), [1, 2], 0), ([5, 6, 7], [3], 0),
                   (list(range(40, 58)), [4, 5], 17)])]
    cfg = models["torch"].cfg
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 8, 16, cfg.num_kv_heads, cfg.head_dim, generator=gen)
              for _ in range(cfg.num_layers)]
    hidden, written = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            ids, pos, meta, _ = build_step_inputs(states, [21, 3, 1], 16, cpu)
            written[name] = [c.clone() for c in caches]
            hidden[name] = model(ids, pos, written[name], meta)
    torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-4, rtol=1e-4)
    for got, want in zip(written["triton"], written["torch"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
