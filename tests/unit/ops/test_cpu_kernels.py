"""The compiled CPU kernels (csrc/cpu) against their PyTorch references.

Each test runs once per instruction-set variant (``cpu_kernels`` in conftest.py), on the ops
of that variant (``cpu_kernels.ops``) and the backend made from them; a variant this CPU
cannot run, or that does not build here, is skipped with the reason, and the engine uses the
references. The variants share their sources, so most tests are the same for both; the linear
layers are each set's own
(``cpu_ops`` markers: AVX-512's skinny bf16 matmul, AVX2's bf16-weight fp32 matmul).
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch

from tests.attention_steps import STEPS, make_step, nan_outside_requests, random_inputs
from engine_worker.backends.reference import TorchAttentionBackend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rope

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # once per variant

NUM_BLOCKS = 96
LANES = {"avx512": 16, "avx2": 8}  # fp32 lanes of a vector (csrc/cpu/<isa>/simd.h)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype):
    # one bf16 / fp16 rounding step apart at most (the kernels round intermediates where the
    # references do, but sum in another order)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- RMSNorm, SwiGLU, RoPE

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("extra_vectors", [0, 1])  # hidden = 576 + one vector: an odd count
def test_rms_norm_matches_reference(dtype, rows, extra_vectors, cpu_kernels):
    torch.manual_seed(rows)
    hidden = 576 + extra_vectors * LANES[cpu_kernels.isa]
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    weight = (1 + torch.randn(hidden) / 4).to(dtype)
    _close(cpu_kernels.ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), dtype)


def test_rms_norm_reads_strided_rows(cpu_kernels):
    x = torch.randn(5, 2 * 576)[:, :576]  # rows of a wider tensor
    weight = torch.randn(576)
    _close(cpu_kernels.ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("extra_vectors", [0, 1])
def test_add_rms_norm_is_torchs_add_then_the_kernels_norm_bit_for_bit(dtype, rows,
                                                                     extra_vectors, cpu_kernels):
    """The layer stack's residual add and the norm after it, in one pass: h becomes h + x
    rounded as torch's add_ rounds it, and the output is rms_norm of that, to the bit."""
    torch.manual_seed(rows)
    hidden = 576 + extra_vectors * LANES[cpu_kernels.isa]
    h, x = ((torch.randn(rows, hidden) * 3).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(hidden) / 4).to(dtype)
    want_h = h + x
    want = cpu_kernels.ops.rms_norm(want_h, weight, 1e-5)
    got = cpu_kernels.ops.add_rms_norm(h, x, weight, 1e-5)
    assert torch.equal(h, want_h) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_into_is_torchs_add_bit_for_bit(dtype, cpu_kernels):
    torch.manual_seed(1)
    a, b = ((torch.randn(300, 576) * 3).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    cpu_kernels.ops.add_into(out, a, b)
    assert torch.equal(out, a + b)
    cpu_kernels.ops.add_into(a, a, b)  # in place, as the layer stack sums into its output
    assert torch.equal(a, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_silu_and_mul_matches_reference(dtype, rows, cpu_kernels):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0]).to(dtype)  # exp's clamped range
    _close(cpu_kernels.ops.silu_and_mul(x), silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_reference_in_place(dtype, cpu_kernels):
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
    cpu_kernels.ops.rotary_embedding(q, k, positions, rope.cos, rope.sin)  # where they lie
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(qkv[:, 12 * 64:], untouched_v)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_kernels.ops.rotary_embedding(q, k, torch.tensor([2048] * len(positions)), rope.cos,
                                   rope.sin)


# ---------------------------------------------------------------- paged attention

def _seed(*key) -> int:
    """A case's seed, the same in every process (hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


# (query dtype, cache dtype): the cache in the queries' dtype, or narrower under fp32 queries
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS,
                         ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (4, 4, 32)],
                         ids=lambda h: "{}:{}-d{}".format(*h))
@pytest.mark.parametrize("step", sorted(STEPS))
def test_paged_attention_matches_reference(step, heads, block_size, dtypes, cpu_kernels):
    q_dtype, cache_dtype = dtypes
    rng = random.Random(_seed(step, heads, block_size))
    torch.manual_seed(rng.randrange(1 << 30))
    meta = make_step(rng, STEPS[step], block_size, NUM_BLOCKS)
    q, k, v, cache = random_inputs(meta, heads, NUM_BLOCKS, block_size, q_dtype, cache_dtype)
    scale = heads[2] ** -0.5

    # the reference in the queries' dtype over the cache's values (which the kernel widens)
    ref_cache = cache.to(q_dtype)
    want = TorchAttentionBackend().forward(q, k.to(cache_dtype).to(q_dtype),
                                           v.to(cache_dtype).to(q_dtype), ref_cache, meta, scale)
    # what an attention backend runs a layer: the cache write, then one varlen call
    got = cpu_kernels.backend.attention.forward(q, k, v, cache, meta, scale)

    assert torch.equal(cache.to(q_dtype), ref_cache)  # the same K/V written to the same slots
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_paged_attention_reads_only_its_own_blocks(cpu_kernels):
    """Garbage (NaN) everywhere outside the requests' blocks must not reach the output."""
    rng = random.Random(7)
    meta = make_step(rng, STEPS["mixed"], 16, NUM_BLOCKS)
    cache = nan_outside_requests(meta, NUM_BLOCKS, 16, 3, 64)
    q, k, v, _ = random_inputs(meta, (9, 3, 64), NUM_BLOCKS, 16, torch.float32)
    out = cpu_kernels.backend.attention.forward(q, k, v, cache, meta, 0.125)
    assert not out.isnan().any()


@pytest.mark.parametrize("context_len", [127, 128, 200, 333, 1000])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 64), (4, 4, 32)],
                         ids=lambda h: "{}:{}-d{}".format(*h))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)],
                         ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_a_lone_long_decode_split_over_its_keys_matches_reference(context_len, heads, dtypes,
                                                                   cpu_kernels):
    """With two threads a decode alone in its step is split by kv head, and where its kv
    heads are fewer than two items a thread (3 or 1 here) by keys too, merged after (on the
    fp32 path and, bf16 on AVX-512 BF16, on that set's own decode kernel): the output is the
    reference's, and so is one thread's, which splits nothing; a garbage (NaN) slot outside
    the request, or past its length, never reaches it."""
    q_dtype, cache_dtype = dtypes
    rng = random.Random(context_len)
    torch.manual_seed(context_len)
    meta = make_step(rng, [(context_len, 1)], 16, NUM_BLOCKS)
    q, k, v, cache = random_inputs(meta, heads, NUM_BLOCKS, 16, q_dtype, cache_dtype)
    garbage = nan_outside_requests(meta, NUM_BLOCKS, 16, heads[1], heads[2])
    cache = torch.where(garbage.isnan(), garbage, cache.float()).to(cache_dtype)
    scale = heads[2] ** -0.5
    ref_cache = cache.to(q_dtype).nan_to_num()
    want = TorchAttentionBackend().forward(q, k.to(cache_dtype).to(q_dtype),
                                           v.to(cache_dtype).to(q_dtype), ref_cache, meta, scale)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta, scale))
    finally:
        torch.set_num_threads(threads)
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-5
    for got in outs:
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# long bf16 prefills (the AMX tile kernel's 16-row tiles and 64-key blocks, partly filled),
# some over cached context, beside decodes
LONG_STEPS = {
    "prompts": [(0, 300), (0, 17), (0, 129)],
    "chunks_over_context": [(5, 1), (250, 1), (100, 150), (63, 65), (1, 1)],
}


def _amx_here() -> bool:
    return {"amx_tile", "amx_bf16", "amx_int8"} <= set(Path("/proc/cpuinfo").read_text().split())


@pytest.mark.cpu_ops("attention_tiles")
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (4, 2, 256), (10, 2, 64)],
                         ids=lambda h: "{}:{}-d{}".format(*h))
@pytest.mark.parametrize("step", sorted(LONG_STEPS))
def test_bf16_prefill_on_amx_tiles_and_vectors_both_match_reference(step, heads, cpu_kernels):
    """Prefill attention runs on AMX tiles exactly where the CPU has them (the real AVX-512
    set, read from /proc/cpuinfo), and both it and the AVX-512 BF16 vector kernel match the
    reference; the two are different code (their outputs differ in some bits)."""
    ops = cpu_kernels.ops
    tiles_here = _amx_here() and cpu_kernels.kernels.variant.name == "avx512"
    rng = random.Random(_seed(step, heads))
    torch.manual_seed(rng.randrange(1 << 30))
    meta = make_step(rng, LONG_STEPS[step], 16, 128)
    q, k, v, cache = random_inputs(meta, heads, 128, 16, torch.bfloat16)
    scale = heads[2] ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, scale)
    outs = {}
    try:
        for tiles in (True, False):
            assert ops.attention_tiles(tiles) == (tiles and tiles_here)
            outs[tiles] = cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta,
                                                                scale)
            torch.testing.assert_close(outs[tiles].float(), want.float(), atol=2e-2, rtol=2e-2)
    finally:
        ops.attention_tiles(True)
    assert torch.equal(outs[True], outs[False]) != tiles_here


@pytest.mark.cpu_ops("attention_tiles")
def test_bf16_prefill_on_amx_tiles_reads_only_its_own_blocks(cpu_kernels):
    """NaN everywhere outside the requests' blocks (and past each one's length inside its last
    block) must not reach a bf16 output, tiles or vectors: padding keys and rows are zeros."""
    rng = random.Random(11)
    meta = make_step(rng, LONG_STEPS["chunks_over_context"], 16, 128)
    cache = nan_outside_requests(meta, 128, 16, 3, 64).bfloat16()
    q, k, v, _ = random_inputs(meta, (9, 3, 64), 128, 16, torch.bfloat16)
    try:
        for tiles in (True, False):
            cpu_kernels.ops.attention_tiles(tiles)
            out = cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta, 0.125)
            assert not out.isnan().any()
    finally:
        cpu_kernels.ops.attention_tiles(True)


# bf16 decodes alone: the AMX decode kernel's group sizes (1-4 query heads per kv head; 5 is
# the vector kernel's), head dims, and chunks of 16 keys read in place (block size 16 or 32)
# or copied (block size 8: two blocks, adjacent or not; and every sequence's partial last chunk)
DECODES = [(0, 1), (15, 1), (16, 1), (47, 1), (200, 1), (319, 1)]


@pytest.mark.cpu_ops("attention_tiles")
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(3, 3, 64), (6, 3, 64), (9, 3, 64), (8, 2, 128), (4, 1, 256),
                                   (10, 2, 64)], ids=lambda h: "{}:{}-d{}".format(*h))
def test_bf16_decode_on_amx_tiles_and_vectors_both_match_reference(heads, block_size,
                                                                   cpu_kernels):
    """Decode scores run on AMX tiles exactly where the CPU has them and the group has at
    most 4 query heads; tiles and vectors both match the reference, and NaN outside the
    sequences' keys (other blocks, past the end in the last one) reaches neither."""
    ops = cpu_kernels.ops
    tiles_here = (_amx_here() and cpu_kernels.kernels.variant.name == "avx512"
                  and heads[0] // heads[1] <= 4)
    rng = random.Random(hash((heads, block_size)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    num_blocks = 512 // block_size * len(DECODES)
    meta = make_step(rng, DECODES, block_size, num_blocks)
    q, k, v, _ = random_inputs(meta, heads, num_blocks, block_size, torch.bfloat16)
    cache = nan_outside_requests(meta, num_blocks, block_size, heads[1], heads[2]).bfloat16()
    clean = cache.nan_to_num(0.0)
    scale = heads[2] ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, clean.clone(), meta, scale)
    outs = {}
    try:
        for tiles in (True, False):
            ops.attention_tiles(tiles)
            outs[tiles] = cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta,
                                                                scale)
            assert not outs[tiles].isnan().any()
            torch.testing.assert_close(outs[tiles].float(), want.float(), atol=2e-2, rtol=2e-2)
    finally:
        ops.attention_tiles(True)
    if heads[0] // heads[1] > 4 or not tiles_here:  # both runs took the vector kernel
        assert torch.equal(outs[True], outs[False])


def test_bf16_decode_reads_a_chunk_by_stride_only_where_its_keys_are_one_slot_apart(
        cpu_kernels):
    """A chunk of 16 keys is read by stride where its slots are consecutive: with blocks of 4,
    each chunk's first and fourth blocks lie in order but its second and third do not (blocks
    0, 9, 10, 3, then 4, 13, 14, 7, then 8, 1, 2, 11), so only reading every key's own slot
    matches the reference (a check of the chunk's ends alone read blocks 1 and 2 for 9 and 10
    here, and failed)."""
    rng = random.Random(11)
    torch.manual_seed(11)
    blocks = [0, 9, 10, 3, 4, 13, 14, 7, 8, 1, 2, 11]
    meta = make_step(rng, [(47, 1)], 4, 16, block_ids_of=[blocks])
    heads = (9, 3, 64)
    q, k, v, _ = random_inputs(meta, heads, 16, 4, torch.bfloat16)
    cache = nan_outside_requests(meta, 16, 4, heads[1], heads[2]).bfloat16()
    want = TorchAttentionBackend().forward(q, k, v, cache.nan_to_num(0.0), meta, 0.125)
    got = cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cpu_ops("attention_tiles")
def test_bf16_decode_tiles_are_another_kernel_than_vectors(cpu_kernels):
    """Where the CPU has tiles, a batch of 64 decodes (36,864 outputs) differs from the vector
    kernel's in some bits (their scores sum in another order), so the tiles did run; elsewhere
    both runs are the vector kernel's, bit for bit."""
    ops = cpu_kernels.ops
    tiles_here = _amx_here() and cpu_kernels.kernels.variant.name == "avx512"
    rng = random.Random(5)
    torch.manual_seed(5)
    meta = make_step(rng, [(rng.randrange(100, 400), 1) for _ in range(64)], 16, 64 * 26)
    q, k, v, cache = random_inputs(meta, (9, 3, 64), 64 * 26, 16, torch.bfloat16)
    outs = {}
    try:
        for tiles in (True, False):
            ops.attention_tiles(tiles)
            outs[tiles] = cpu_kernels.backend.attention.forward(q, k, v, cache.clone(), meta,
                                                                0.125)
    finally:
        ops.attention_tiles(True)
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(outs[True], outs[False]) != tiles_here


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_write_kv_narrows_as_torch_casts(cache_dtype, cpu_kernels):
    """fp32 K/V into a narrower cache: torch's rounding (to nearest even), bit for bit, with
    ties, NaN, infinities, signed zeros and subnormals."""
    k = torch.randn(40, 3, 64) * 100
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-39, 3e38, 65519.0,
               70000.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11]
    k.view(-1)[:len(special)] = torch.tensor(special)
    v = -k
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=cache_dtype)
    slots = torch.randperm(8 * 16)[:40]
    cpu_kernels.ops.write_kv(cache, k, v, slots)
    got_k = cache[0].view(-1, 3, 64)[slots]
    got_v = cache[1].view(-1, 3, 64)[slots]
    for got, want in ((got_k, k.to(cache_dtype)), (got_v, v.to(cache_dtype))):
        # a NaN stays a NaN (its payload bits are torch's own choice)
        assert torch.equal(got.isnan(), want.isnan())
        keep_inf = {"posinf": float("inf"), "neginf": -float("inf")}
        assert torch.equal(got.nan_to_num(0.0, **keep_inf).view(torch.int16),
                           want.nan_to_num(0.0, **keep_inf).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_takes_views_of_a_projection(dtype, cpu_kernels):
    """K and V as the fused stack passes them (views into one QKV output, token rows apart)
    are written where their contiguous copies would be; a view whose heads do not lie side by
    side (a transposed one) is copied first, and written the same."""
    qkv = torch.randn(5, 9 * 64, dtype=dtype)
    k = qkv[:, 3 * 64:6 * 64].view(5, 3, 64)
    v = qkv[:, 6 * 64:].view(5, 3, 64)
    slots = torch.tensor([17, 3, 40, 41, 99])
    want = torch.zeros(2, 8, 16, 3, 64, dtype=dtype)
    cpu_kernels.ops.write_kv(want, k.contiguous(), v.contiguous(), slots)
    got = torch.zeros_like(want)
    cpu_kernels.ops.write_kv(got, k, v, slots)
    assert not k.is_contiguous() and torch.equal(got, want)
    heads_apart = k.contiguous().transpose(1, 2).contiguous().transpose(1, 2)
    got.zero_()
    cpu_kernels.ops.write_kv(got, heads_apart, v, slots)
    assert torch.equal(got, want)


def test_write_kv_rejects_out_of_range_slot(cpu_kernels):
    cache = torch.zeros(2, 4, 16, 3, 64)
    k = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.ops.write_kv(cache, k, k, torch.tensor([4 * 16]))


# ---------------------------------------------------------------- AVX-512: bf16 skinny matmul

@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 35)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.cpu_ops("skinny_linear")
def test_skinny_linear_matches_torch(rows, shape, bias, cpu_kernels):
    in_features, out_features = shape
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    got = cpu_kernels.ops.skinny_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # both accumulate in fp32 and round once; only the summation order differs
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    # what the engine calls: the packed weight through the layer's kernel
    packed = cpu_kernels.backend.pack_weight(w)
    assert (packed.skinny is not None) == (out_features % 4 == 0)
    torch.testing.assert_close(cpu_kernels.backend.linear(x, w, b, packed).float(), want,
                               atol=2e-2, rtol=1e-2)
    # and more rows than the skinny kernel takes go through oneDNN's packed layout
    many = torch.randn(3 * rows + 9, in_features).bfloat16()
    torch.testing.assert_close(
        cpu_kernels.backend.linear(many, w, b, packed).float(),
        torch.nn.functional.linear(many.float(), w.float(), None if b is None else b.float()),
        atol=2e-2, rtol=1e-2)


def _special_weights(out_features, in_features, seed):
    """Trained-like weights with the values a bit layout could get wrong: zeros of both signs,
    subnormals, the largest finite, infinities and a NaN, within 16 exponents a row."""
    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features) / in_features ** 0.5
    w = torch.where(w.abs() < 2.0 ** -10, 0.0, w).bfloat16()  # Gaussian tails, cut off
    w[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39]).bfloat16()  # zeros and subnormals
    w[1, 5] = float("inf")
    w[2, 7] = float("-inf")
    w[3, 9] = torch.finfo(torch.bfloat16).max
    w[3, 10] = float("nan")
    return w


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 36)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")
def test_coded_layout_is_the_plain_layout_bit_for_bit(rows, shape, bias, cpu_kernels):
    """The exponent-coded weight decodes to the same bits in the same order: the products are
    the plain packed kernel's exactly, NaN and infinities included."""
    in_features, out_features = shape
    w = _special_weights(out_features, in_features, rows + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    coded = cpu_kernels.ops.pack_coded(w)
    assert coded.dtype == torch.uint8 and coded.numel() > 0
    # 12 bits a weight plus a 16-word table a row (three quarters of the bf16 bytes, plus 32
    # bytes a row)
    assert coded.numel() == out_features * (in_features * 12 // 8 + 32)
    plain = cpu_kernels.ops.skinny_linear_packed(x, cpu_kernels.ops.pack_skinny(w), b)
    got = cpu_kernels.ops.skinny_linear_packed(x, coded, b)
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))  # NaN's bits too
    # the engine packs this weight coded, and its linear layer gives the same bits
    packed = cpu_kernels.backend.pack_weight(w)
    assert packed.skinny.dtype == torch.uint8
    assert torch.equal(cpu_kernels.backend.linear(x, w, b, packed).view(torch.int16),
                       plain.view(torch.int16))


def _decode_coded(coded: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The coded layout read back in Python, as csrc/cpu/avx512/linear.cpp documents it ->
    int16 bits."""
    groups, slices = out_features // 4, in_features // 32
    tables = coded[:, :128].contiguous().view(torch.int16).view(groups, 4, 16).long() & 0xFFFF
    body = coded[:, 128:].reshape(groups, slices, 192)
    i = torch.arange(32)
    rows = []
    for q in range(4):
        sm = body[:, :, (q // 2) * 64 + 16 * (i // 8) + 8 * (q % 2) + i % 8].long()
        codes = body[:, :, 128:].contiguous().view(torch.int16).long() & 0xFFFF
        code = (codes >> (4 * q)) & 0xF  # [groups, slices, 32]
        exp7 = torch.gather(tables[:, q], 1, code.reshape(groups, -1)).reshape(code.shape)
        rows.append(((sm & 0x80) << 8) | (sm & 0x7F) | exp7)
    bits = torch.stack(rows, 1).reshape(groups, 4, in_features).reshape(out_features, -1)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 36)])
@pytest.mark.cpu_ops("pack_coded")
def test_coded_layout_holds_every_weight_bit(shape, cpu_kernels):
    """Read back, the coded bytes are the weight's bits exactly: the products cannot show a
    lost subnormal (the dot product flushes them) or the sign of a zero."""
    in_features, out_features = shape
    w = _special_weights(out_features, in_features, out_features)
    decoded = _decode_coded(cpu_kernels.ops.pack_coded(w), out_features, in_features)
    assert torch.equal(decoded, w.view(torch.int16))


@pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")
def test_rows_with_more_than_16_exponents_stay_plain(cpu_kernels):
    w = (torch.randn(8, 64) / 8).bfloat16()
    w[5, :20] = torch.tensor([2.0 ** -e for e in range(20)]).bfloat16()  # 20 exponents in a row
    assert cpu_kernels.ops.pack_coded(w).numel() == 0
    packed = cpu_kernels.backend.pack_weight(w)
    assert packed.skinny.dtype == torch.bfloat16  # the plain streamed layout
    x = torch.randn(2, 64).bfloat16()
    ops = cpu_kernels.ops
    assert torch.equal(cpu_kernels.backend.linear(x, w, None, packed),
                       ops.skinny_linear_packed(x, ops.pack_skinny(w), None))


@pytest.mark.cpu_ops("skinny_linear")
def test_skinny_linear_rejects_what_it_cannot_run(cpu_kernels):
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        cpu_kernels.ops.skinny_linear(torch.zeros(9, 64).bfloat16(), torch.zeros(8, 64).bfloat16(),
                                None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.ops.skinny_linear(torch.zeros(1, 48).bfloat16(), torch.zeros(8, 48).bfloat16(),
                                None)


# ---------------------------------------------------------------- AVX2: bf16 weights, fp32 math

@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("shape", [(576, 1728), (1536, 576), (37, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.cpu_ops("pack_bf16w", "linear_bf16w")
def test_linear_bf16w_matches_fp32_matmul(rows, shape, bias, cpu_kernels):
    in_features, out_features = shape
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features)
    w = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features) if bias else None
    packed = cpu_kernels.ops.pack_bf16w(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == w.numel()
    got = cpu_kernels.ops.linear_bf16w(x, packed, b)
    # the fp32 matmul of the bf16 weight's values: only the summation order differs
    want = torch.nn.functional.linear(x, w.float(), b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.cpu_ops("pack_bf16w", "linear_bf16w")
def test_linear_bf16w_reads_strided_rows(cpu_kernels):
    x = torch.randn(9, 2 * 64)[:, :64]  # rows of a wider tensor
    w = torch.randn(32, 64).bfloat16()
    torch.testing.assert_close(cpu_kernels.ops.linear_bf16w(x, cpu_kernels.ops.pack_bf16w(w), None),
                               x @ w.float().T, atol=1e-4, rtol=1e-4)


@pytest.mark.cpu_ops("pack_bf16w", "linear_bf16w")
def test_linear_bf16w_rejects_what_it_cannot_run(cpu_kernels):
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        cpu_kernels.ops.pack_bf16w(torch.zeros(24, 64).bfloat16())
    packed = cpu_kernels.ops.pack_bf16w(torch.zeros(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels.ops.linear_bf16w(torch.zeros(2, 64).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="K"):
        cpu_kernels.ops.linear_bf16w(torch.zeros(2, 48), packed, None)
