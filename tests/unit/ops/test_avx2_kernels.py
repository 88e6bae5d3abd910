"""The AVX2 + FMA kernel set (csrc/cpu/avx2, ``torch.ops.quire_avx2``) against its PyTorch
references.

The set builds with explicit ``-mavx2 -mfma -mf16c`` flags, so it runs on any x86 CPU with
those (AVX-512 machines included); elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.attention_steps import STEPS, make_step
from engine_worker.backends import BACKENDS
from engine_worker.backends.cpu_avx2 import CPU_AVX2 as AVX2
from engine_worker.backends.reference import TorchAttentionBackend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.ops import cpu_ops_unavailable_reason, load_cpu_ops
from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm, rms_norm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rope
from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM



# built by engine_worker.ops like the engine's own (any x86 CPU with AVX2, FMA and F16C: the
# AVX-512 machines run this set too)
pytestmark = pytest.mark.skipif(cpu_ops_unavailable_reason("avx2") is not None,
                                reason=f"AVX2 kernels: {cpu_ops_unavailable_reason('avx2')}")
ops = load_cpu_ops("avx2") if cpu_ops_unavailable_reason("avx2") is None else None

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


# ---------------------------------------------------------------- paged attention

NUM_BLOCKS = 96


def _step(rng, shapes, block_size):
    return make_step(rng, shapes, block_size, NUM_BLOCKS)


def _attend(q, k, v, cache, meta, scale):
    """What an AVX2 attention backend runs a layer: the cache write, then one varlen call."""
    ops.write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                        scale)
    return out


# (query dtype, cache dtype): the cache in the queries' dtype, or narrower under fp32 queries
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS,
                         ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_paged_attention_matches_reference(step, heads, block_size, dtypes):
    q_dtype, cache_dtype = dtypes
    rng = random.Random(hash((step, heads, block_size)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    num_heads, num_kv_heads, head_dim = heads
    meta = _step(rng, STEPS[step], block_size)
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, num_heads, head_dim).to(q_dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(q_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(q_dtype)
    cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim).to(cache_dtype)
    scale = head_dim ** -0.5

    # the reference in the queries' dtype over the cache's values (which the kernel widens)
    ref_cache = cache.to(q_dtype)
    want = TorchAttentionBackend().forward(q, k.to(cache_dtype).to(q_dtype),
                                           v.to(cache_dtype).to(q_dtype), ref_cache, meta, scale)
    got = _attend(q, k, v, cache, meta, scale)

    assert torch.equal(cache.to(q_dtype), ref_cache)  # the same K/V written to the same slots
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_paged_attention_reads_only_its_own_blocks():
    """Garbage (NaN) everywhere outside the requests' blocks must not reach the output."""
    rng = random.Random(7)
    meta = _step(rng, STEPS["mixed"], 16)
    num_tokens = int(meta.query_start_loc[-1])
    used = set(meta.block_tables.flatten().tolist())
    cache = torch.full((2, NUM_BLOCKS, 16, 3, 64), float("nan"))
    for b in used:
        cache[:, b] = torch.randn(2, 16, 3, 64)
    # positions past each request's length inside its last block stay NaN as well
    q, k, v = torch.randn(num_tokens, 9, 64), torch.randn(num_tokens, 3, 64), torch.randn(
        num_tokens, 3, 64)
    for i, n in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i]
        for pos in range(n, -(-n // 16) * 16):
            cache[:, table[pos // 16], pos % 16] = float("nan")
    out = _attend(q, k, v, cache, meta, 0.125)
    assert not out.isnan().any()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_write_kv_narrows_as_torch_casts(cache_dtype):
    """fp32 K/V into a narrower cache: torch's rounding (to nearest even), bit for bit, with
    ties, NaN, infinities, signed zeros and subnormals."""
    k = torch.randn(40, 3, 64) * 100
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-39, 3e38, 65519.0,
               70000.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11]
    k.view(-1)[:len(special)] = torch.tensor(special)
    v = -k
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=cache_dtype)
    slots = torch.randperm(8 * 16)[:40]
    ops.write_kv(cache, k, v, slots)
    got_k = cache[0].view(-1, 3, 64)[slots]
    got_v = cache[1].view(-1, 3, 64)[slots]
    for got, want in ((got_k, k.to(cache_dtype)), (got_v, v.to(cache_dtype))):
        # a NaN stays a NaN (its payload bits are torch's own choice)
        assert torch.equal(got.isnan(), want.isnan())
        keep_inf = {"posinf": float("inf"), "neginf": -float("inf")}
        assert torch.equal(got.nan_to_num(0.0, **keep_inf).view(torch.int16),
                           want.nan_to_num(0.0, **keep_inf).view(torch.int16))


def test_write_kv_rejects_out_of_range_slot():
    cache = torch.zeros(2, 4, 16, 3, 64)
    k = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(cache, k, k, torch.tensor([4 * 16]))


# ---------------------------------------------------------------- bf16 weights, fp32 activations

@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("shape", [(576, 1728), (1536, 576), (37, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16w_matches_fp32_matmul(rows, shape, bias):
    in_features, out_features = shape
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features)
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features) if bias else None
    packed = ops.pack_bf16w(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == w.numel()
    got = ops.linear_bf16w(x, packed, b)
    # the fp32 matmul of the bf16 weight's values: only the summation order differs
    want = torch.nn.functional.linear(x, w.float(), b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_linear_bf16w_reads_strided_rows():
    x = torch.randn(9, 2 * 64)[:, :64]  # rows of a wider tensor
    w = torch.randn(32, 64).bfloat16()
    torch.testing.assert_close(ops.linear_bf16w(x, ops.pack_bf16w(w), None), x @ w.float().T,
                               atol=1e-4, rtol=1e-4)


def test_linear_bf16w_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        ops.pack_bf16w(torch.zeros(24, 64).bfloat16())
    packed = ops.pack_bf16w(torch.zeros(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="fp32"):
        ops.linear_bf16w(torch.zeros(2, 64).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="K"):
        ops.linear_bf16w(torch.zeros(2, 48), packed, None)


# ---------------------------------------------------------------- fused halves and the layer stack

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def _linear(in_features, out_features, bias, weight_dtype):
    lin = Linear(in_features, out_features, bias, AVX2.linear, AVX2.pack_weight)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features) / in_features ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(out_features) / 4)
    lin.weight.data = lin.weight.data.to(weight_dtype)  # the bias stays fp32
    lin.pack()
    return lin


def _layer(bias: bool, weight_dtype):
    """A SmolLM2-shaped layer with fp32 norms and activations, linear weights in weight_dtype."""
    torch.manual_seed(int(bias))
    rope = RopeConfig(head_dim=HEAD_DIM, theta=10000.0, max_position_embeddings=4096)
    norms = [RMSNorm(HIDDEN, 1e-5, AVX2.rms_norm) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + torch.randn(HIDDEN) / 4)
    return {
        "norm1": norms[0], "norm2": norms[1],
        "qkv": _linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias, weight_dtype),
        "o": _linear(HEADS * HEAD_DIM, HIDDEN, bias, weight_dtype),
        "gate_up": _linear(HIDDEN, 2 * INTERMEDIATE, bias, weight_dtype),
        "down": _linear(INTERMEDIATE, HIDDEN, bias, weight_dtype),
        "rotary": RotaryEmbedding(rope, 4096, torch.device("cpu"), AVX2.rope),
    }


def test_fused_ops_name_what_is_wrong():
    m = _layer(False, torch.bfloat16)
    w = m["qkv"].packed.panels
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        ops.norm_qkv_rope(torch.zeros(2, HIDDEN).bfloat16(), m["norm1"].weight, 1e-5, w, w, None,
                          torch.zeros(2, dtype=torch.long), m["rotary"].cos, m["rotary"].sin,
                          HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv heads"):
        ops.norm_qkv_rope(torch.zeros(2, HIDDEN), m["norm1"].weight, 1e-5, w, w, None,
                          torch.zeros(2, dtype=torch.long), m["rotary"].cos, m["rotary"].sin,
                          HEADS - KV_HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="pack_bf16w's, fp32"):
        ops.norm_qkv_rope(torch.zeros(2, HIDDEN), m["norm1"].weight, 1e-5, w.float(),
                          w.float(), None, torch.zeros(2, dtype=torch.long), m["rotary"].cos,
                          m["rotary"].sin, HEADS, KV_HEADS)


def _tiny_llama(backend, bias: bool) -> LlamaForCausalLM:
    # head_dim 32, every output size a multiple of 16 (the panels')
    cfg = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=3,
                      num_heads=6, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                      rope=RopeConfig(head_dim=32, theta=10000.0, max_position_embeddings=1024),
                      tie_word_embeddings=True, qkv_bias=bias, o_bias=bias)
    return LlamaForCausalLM(cfg, backend, 1024, torch.device("cpu"))


def _run(model, meta, input_ids, positions, caches):
    caches = [c.clone() for c in caches]
    with torch.no_grad():
        hidden = model(input_ids, positions, caches, meta)
        return model.compute_logits(hidden), caches


@pytest.mark.parametrize("bias", [False, True])
def test_llama_on_avx2_kernels(bias):
    """A whole model on this set: in fp32 the one-call layers are the per-layer path bit for
    bit, and both the reference's result; a bf16 model (bf16 weights and cache, its layers'
    activations in fp32) is the fp32 model of its bf16 values up to the cache's rounding."""
    torch.manual_seed(3)
    reference = _tiny_llama(BACKENDS["torch"], bias)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (1 if p.dim() == 1 else 0))
    rng = random.Random(5)
    meta = _step(rng, STEPS["mixed"], 16)
    num_tokens = int(meta.query_start_loc[-1])
    input_ids = torch.randint(0, 512, (num_tokens,))
    positions = torch.cat([torch.arange(int(n) - int(e - s), int(n)) for n, s, e in zip(
        meta.seq_lens, meta.query_start_loc[:-1], meta.query_start_loc[1:])])
    caches = [torch.randn(2, NUM_BLOCKS, 16, 2, 32) for _ in range(3)]
    reference.pack_weights()
    want, want_caches = _run(reference, meta, input_ids, positions, caches)

    model = _tiny_llama(AVX2, bias)
    model.load_state_dict(reference.state_dict())
    model.pack_weights()
    assert model.layer_stack is not None
    stacked, stacked_caches = _run(model, meta, input_ids, positions, caches)
    model.layer_stack = None
    per_layer, per_layer_caches = _run(model, meta, input_ids, positions, caches)
    assert torch.equal(stacked, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(stacked_caches, per_layer_caches))
    torch.testing.assert_close(stacked, want, atol=1e-3, rtol=1e-3)

    # bf16: the reference in fp32 over the bf16-rounded weights and cache
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.bfloat16().float())
    reference.pack_weights()
    bf16_caches = [c.bfloat16() for c in caches]
    want, _ = _run(reference, meta, input_ids, positions,
                   [c.float() for c in bf16_caches])
    model = _tiny_llama(AVX2, bias).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    model.pack_weights()
    assert model.layer_stack is not None
    assert model.layers[0].self_attn.qkv_proj.packed is not None
    got, _ = _run(model, meta, input_ids, positions, bf16_caches)
    # logits rounded to bf16 (the model's dtype) at the end: one bf16 step of logits ~10
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
