"""The small-op Triton kernels (engine_worker/backends/triton_ops.py) on a real GPU: each against
its torch reference on CUDA, and the triton backend's engine (fused Llama stack, CUDA graphs)
greedy-decoding what the torch backend's does. Skipped without a GPU (the kernels run under
the interpreter in tests/unit/attention/test_triton_ops.py); run with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

pytest.importorskip("triton")

from engine_worker import LLM, SamplingParams  # noqa: E402
from engine_worker.backends import triton_ops  # noqa: E402
from engine_worker.layers.activation import silu_and_mul  # noqa: E402
from engine_worker.layers.norm import rms_norm  # noqa: E402
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rope  # noqa: E402
from tests.e2e.test_hf_parity import TINY_PROMPTS  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 4096), (3, 8192)])
def test_norms_and_silu_on_gpu_match_reference(dtype, rows, hidden):
    torch.manual_seed(hidden + rows)
    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    residual = torch.randn(rows, hidden, device=DEV).to(dtype)
    weight = torch.randn(hidden, device=DEV).to(dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6).float(),
                               rms_norm(x, weight, 1e-6).float(), **TOL[dtype])
    want_residual = residual + x
    got = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual.float(), want_residual.float(), **TOL[dtype])
    torch.testing.assert_close(got.float(), rms_norm(want_residual, weight, 1e-6).float(),
                               **TOL[dtype])
    gate_up = torch.randn(rows, 2 * hidden, device=DEV).to(dtype) * 3
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up).float(),
                               silu_and_mul(gate_up).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (16, 16, 80)])
def test_rope_on_gpu_matches_reference(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads)
    rotary = RotaryEmbedding(RopeConfig(head_dim, 10000.0, 8192), 8192, DEV)
    n = 67
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(n, q_size + 2 * kv_size, device=DEV).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (n,), device=DEV)
    want_q, want_k = apply_rope(positions, q.float(), k.float(), rotary.cos, rotary.sin)
    triton_ops.rope(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(q.float(), want_q, **TOL[dtype])
    torch.testing.assert_close(k.float(), want_k, **TOL[dtype])


def test_fused_ops_engine_greedy_equals_the_torch_backend(tiny_model_dir):
    """The triton backend (fused Llama stack of these kernels, replayed in CUDA graphs) and the
    torch backend (reference ops, eager) greedy-decode the same tokens on CUDA."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    tokens = {}
    for kernels in ("triton", "torch"):
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", kernels=kernels,
                  max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=1 << 26)
        assert llm.engine.info.backend == kernels
        if kernels == "triton":
            assert llm.engine.runner.model.layer_stack is not None
            assert llm.engine.info.cuda_graphs.startswith("on"), llm.engine.info.cuda_graphs
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[kernels] = [o.outputs[0].token_ids for o in outputs]
        del llm
        torch.cuda.empty_cache()
    assert tokens["triton"] == tokens["torch"]
