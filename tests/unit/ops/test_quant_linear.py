"""GGUF block-quantized linear layers (csrc/cpu/quant_linear.cpp) on every CPU variant, against
de-quantize-then-matmul in fp32, the weights quantized by the ``gguf`` package itself and
de-quantized by its reference (``gguf.quants.dequantize``).

Few rows (decode) quantize x to int8 per block of 32 (ggml's Q8_0): the result differs from the
fp32 reference by at most sum_k |w_k| * d_x(k) / 2, d_x = max|x_block| / 127 (x's rounding), plus
fp32 summation noise; that bound (times 1.01, + 1e-4) is what is asserted, row by row. More rows
stay there for Q4_0 / Q4_1 / Q8_0 in a bf16 model (``quant_int8_rows``), else de-quantize the
weight exactly and run a float matmul: fp32 tolerance (bf16 where x is bf16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from engine_worker.ops.cpu_isa import cpu_flags, cpu_vendor_family, full_width_bf16  # noqa: E402


def amx_cpu() -> bool:
    return {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags()


def bf16_twins_expected(isa: str) -> bool:
    """Whether quantized weights may get bf16 twins here: the AVX-512 set (bf16 activations)
    on a CPU with AMX tiles or a full-width AVX-512 BF16 datapath."""
    return isa == "avx512" and (amx_cpu() or full_width_bf16(*cpu_vendor_family(), cpu_flags()))


def layer_twin_expected(isa: str, qtype: QT) -> bool:
    """Whether a quantized layer weight of ``qtype`` gets a bf16 twin here: where twins are
    kept, every type on AMX tiles; on a full-width AVX-512 BF16 datapath (Zen 5) all but Q4_0
    / Q4_1, which take the int8 kernel at every row count there."""
    return bf16_twins_expected(isa) and (amx_cpu() or qtype not in (QT.Q4_0, QT.Q4_1))


def table_int8_rows(isa: str, rows_limit: int) -> int:
    """The rows of x a tied Q8_0 table's blocks take before its dense twin does: the blocks'
    own limit, or fewer where bf16 twins are kept (AMX: the decode rows; Zen 5: 256)."""
    if not bf16_twins_expected(isa):
        return rows_limit
    return min(8 if amx_cpu() else 256, rows_limit)

TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0)


def quantized(n: int, k: int, qtype: QT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] weight as gguf quantizes it: (blocks uint8 [n, k / 32, bytes], the
    reference de-quantized values fp32 [n, k])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = quantize(w, qtype)  # [n, k / 32 * bytes]
    ref = dequantize(raw, qtype).astype(np.float32)
    block_bytes = raw.shape[1] * 32 // k
    return torch.from_numpy(raw.reshape(n, k // 32, block_bytes).copy()), torch.from_numpy(ref)


def x_rounding_bound(x: torch.Tensor, w_ref: torch.Tensor) -> torch.Tensor:
    """[M, N]: sum_k |w[n, k]| * d_x(m, k) / 2, the error x's int8 rounding can make."""
    m, k = x.shape
    d = x.float().abs().view(m, k // 32, 32).amax(-1) / 127  # [M, K / 32]
    half_step = d.repeat_interleave(32, dim=1) / 2  # [M, K]
    return half_step @ w_ref.abs().T


@pytest.mark.cpu_ops("quant_linear", "dequantize_weight")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(cpu_kernels, qtype):
    blocks, ref = quantized(40, 96, qtype)
    out = cpu_kernels.ops.dequantize_weight(blocks, torch.float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out_bf16 = cpu_kernels.ops.dequantize_weight(blocks, torch.bfloat16)
    torch.testing.assert_close(out_bf16, ref.bfloat16(), rtol=0, atol=0)


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
# rows of x: Q4_0 / Q4_1 take them four at a time over each group of eight weight rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
# 37: rows past the last group of four (and of eight, Q4_0 / Q4_1's interleaved groups); 45:
# five groups of eight, on the AVX-512 set two pairs and one alone
@pytest.mark.parametrize("n", [64, 37, 45])
def test_decode_within_the_int8_rounding_bound(cpu_kernels, qtype, rows, n):
    blocks, ref = quantized(n, 160, qtype, seed=rows)
    x = torch.randn(rows, 160)
    x[0, :32] *= 20  # one block with a large scale
    bias = torch.randn(n)
    out = cpu_kernels.ops.quant_linear(x, blocks, bias)
    expected = x @ ref.T + bias
    bound = x_rounding_bound(x, ref) * 1.01 + 1e-4
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()
    # the bound is tight enough to mean something: far below the output's own size
    assert bound.mean() < 0.1 * expected.abs().mean()


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_zero_rows_of_x_give_exact_zero(cpu_kernels, qtype):
    blocks, _ = quantized(16, 64, qtype)
    out = cpu_kernels.ops.quant_linear(torch.zeros(1, 64), blocks, None)
    assert torch.equal(out, torch.zeros(1, 16))


@pytest.mark.cpu_ops("quant_linear", "quant_int8_rows")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
# 9: one past the decode rows; 65: one past the int8 rows where oneDNN has AMX; 141: a tile
# of 128 rows, then 8 + 5 (the AVX-512 set keeps 8 rows of x in registers); 513: past the old
# 512-row line; 45 weight rows: five groups of eight (on the AVX-512 set two pairs and one
# group alone) and the rows past them
@pytest.mark.parametrize("rows", [9, 33, 65, 141, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_more_rows_int8_or_dequantize_then_matmul(cpu_kernels, qtype, rows, dtype):
    # Past the decode rows a call takes the int8 path where the kernels say so (Q4_0 / Q4_1 /
    # Q8_0 with bf16 x: every size, 64 rows with AMX), else de-quantizes the weight exactly
    # for a float matmul (in x's dtype)
    blocks, ref = quantized(45, 128, qtype, seed=rows)
    x = torch.randn(rows, 128)
    x[-1, 32:64] *= 20  # one block with a large scale, in the last (remainder) row
    x = x.to(dtype)
    out = cpu_kernels.ops.quant_linear(x, blocks, None)
    expected = x.float() @ ref.T
    assert out.shape == (rows, 45) and out.dtype == dtype
    if rows <= cpu_kernels.ops.quant_int8_rows(blocks, dtype):
        bound = x_rounding_bound(x, ref) * 1.01 + 1e-4
        if dtype == torch.bfloat16:  # and one rounding of the result to bf16
            bound = bound + expected.abs() * 2 ** -8
        assert ((out.float() - expected).abs() <= bound).all(), (out.float() - expected).abs().max()
    elif dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # weights rounded to bf16 for the matmul (2^-9 each), and a bf16 result
        bound = (x.float().abs() @ ref.abs().T) * 2 ** -8 + expected.abs() * 2 ** -8 + 1e-4
        assert ((out.float() - expected).abs() <= bound).all(), (out.float() - expected).abs().max()


@pytest.mark.cpu_ops("quant_int8_rows", "amx_tiles")
def test_which_types_keep_many_rows_on_int8(cpu_kernels):
    def limits(dtype):
        return {qt.name: cpu_kernels.ops.quant_int8_rows(quantized(8, 64, qt)[0], dtype)
                for qt in TYPES}
    # Both sets keep a bf16 model's rows of any size on the grouped types' int8 kernel, the
    # AVX-512 set (VNNI) up to 64 rows where oneDNN's matmul has AMX tiles (read here from
    # /proc/cpuinfo, the emulated set's host has none); an fp32 model's rows and the other
    # types are de-quantized past 8
    flags = set(Path("/proc/cpuinfo").read_text().split())
    amx = {"amx_tile", "amx_bf16", "amx_int8"} <= flags
    assert cpu_kernels.ops.amx_tiles() == amx
    many = 64 if amx and cpu_kernels.isa == "avx512" else 2 ** 63 - 1
    assert limits(torch.bfloat16) == {"Q4_0": many, "Q4_1": many, "Q8_0": many}
    assert limits(torch.float32) == {"Q4_0": 8, "Q4_1": 8, "Q8_0": 8}


@pytest.mark.cpu_ops("quant_linear", "quant_int8_rows")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [9, 141])
def test_a_bf16_models_fp32_rows_stay_on_the_int8_path(cpu_kernels, qtype, rows):
    # The AVX2 set carries a bf16 model's activations in fp32 and names the model's dtype
    # (``numerics``): its rows stay on the int8 kernel past the decode rows, each row's result
    # the bits it gets alone (the same blocks, the same sums in the same order); without it
    # (an fp32 model) they are de-quantized exactly
    # (the AVX-512 set draws its line at 64 rows where oneDNN has AMX tiles: test up to there)
    ops = cpu_kernels.ops
    blocks, ref = quantized(45, 128, qtype, seed=rows)
    rows = min(rows, ops.quant_int8_rows(blocks, torch.bfloat16))
    assert rows > 8
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    x[-1, 32:64] *= 20
    out = ops.quant_linear(x, blocks, None, torch.bfloat16)
    assert out.shape == (rows, 45) and out.dtype == torch.float32
    expected = x @ ref.T
    bound = x_rounding_bound(x, ref) * 1.01 + 1e-4
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()
    for r in (0, rows // 2, rows - 1):
        assert torch.equal(out[r], ops.quant_linear(x[r:r + 1], blocks, None)[0])
    torch.testing.assert_close(ops.quant_linear(x, blocks, None), expected, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_decode_is_the_fp32_result_rounded_once(cpu_kernels, qtype, with_bias):
    # bf16 is read and written by the kernel itself: the same bits as widening x to fp32,
    # the fp32 kernel, then one rounding (37 rows: groups of eight and the rows past them)
    blocks, _ = quantized(37, 96, qtype, seed=5)
    x = torch.randn(3, 96).bfloat16()
    bias = torch.randn(37) if with_bias else None
    out = cpu_kernels.ops.quant_linear(x, blocks, bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_kernels.ops.quant_linear(x.float(), blocks, bias).bfloat16())


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_bf16_activations_come_back_in_bf16(cpu_kernels, rows):
    blocks, ref = quantized(32, 64, QT.Q4_1)
    x = torch.randn(rows, 64).bfloat16()
    out = cpu_kernels.ops.quant_linear(x, blocks, None)
    assert out.dtype == torch.bfloat16
    expected = x.float() @ ref.T
    bound = x_rounding_bound(x, ref) * 1.01 + 1e-4
    # one rounding to bf16 on top (relative 2^-8), and bf16 weights in the prefill matmul
    slack = bound + expected.abs() * 2 ** -7 + 1e-2 * (rows > 8)
    assert ((out.float() - expected).abs() <= slack).all()


@pytest.mark.cpu_ops("quant_linear")
def test_bad_block_size_names_the_types(cpu_kernels):
    with pytest.raises(RuntimeError, match=r"Q4_0 \(18\), Q4_1 \(20\), Q8_0 \(34\)"):
        cpu_kernels.ops.quant_linear(torch.randn(1, 64), torch.zeros(4, 2, 19, dtype=torch.uint8),
                                     None)


@pytest.mark.cpu_ops("quant_linear", "repack_gguf")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_loaders_repacked_layout_gives_the_same_bits(cpu_kernels, qtype):
    # K = 320: ten blocks a row, eight through the grouped scales and two through the tail
    blocks, ref = quantized(36, 320, qtype)
    packed = cpu_kernels.ops.repack_gguf(blocks)
    assert packed.dtype == torch.int8 and packed.shape == blocks.shape
    def same_bytes(rows):
        return sorted(packed.view(torch.uint8)[rows].flatten().tolist()) == \
            sorted(blocks[rows].flatten().tolist())
    # whole groups of eight rows are interleaved (rows 0-31 here; on the AVX-512 set pairs of
    # groups are interleaved block by block too), the last four stay row by row
    unit = 16 if cpu_kernels.isa == "avx512" else 8
    assert same_bytes(slice(32, 33)) and same_bytes(slice(35, 36))
    assert same_bytes(slice(0, unit)) and same_bytes(slice(32 - unit, 32))
    assert not same_bytes(slice(3, 4))
    if unit == 16:
        assert not same_bytes(slice(0, 8))
    torch.testing.assert_close(cpu_kernels.ops.dequantize_weight(packed, torch.float32), ref,
                               rtol=0, atol=0)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 320)
        assert torch.equal(cpu_kernels.ops.quant_linear(x, packed, None),
                           cpu_kernels.ops.quant_linear(x, blocks, None))


# ---- the k-quants (Q4_K_M's types): super-blocks of 256 weights ------------------------------
# gguf cannot quantize into them, and any bytes are a valid block once d and dmin are sane
# numbers: random blocks, de-quantized by gguf's reference. Real files (llama.cpp's quantizer)
# are tested in tests/unit/test_gguf_kquants.py.
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def k_quantized(n: int, k: int, qtype: QT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [n, k] super-blocks of ``qtype``: (uint8 [n, k / 256, bytes], gguf's fp32 values)."""
    rng = np.random.default_rng(seed)
    type_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n, k // 256, type_bytes), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        values = (rng.uniform(0.5, 1.5, size=(n, k // 256)) * scale).astype(np.float16)
        return values.view(np.uint8).reshape(n, k // 256, 2)

    if qtype == QT.Q6_K:
        raw[..., 208:210] = halves(1e-4)  # d; the int8 scales span -128..127
    else:
        raw[..., 0:2], raw[..., 2:4] = halves(2e-3), halves(2e-3)  # d, dmin
    ref = dequantize(raw.reshape(n, -1), qtype).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(ref)


@pytest.mark.cpu_ops("quant_linear", "dequantize_weight", "repack_gguf")
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quants_dequantize_matches_gguf(cpu_kernels, qtype):
    blocks, ref = k_quantized(24, 512, qtype)
    for w in (blocks, cpu_kernels.ops.repack_gguf(blocks)):  # the file's layout and ours
        torch.testing.assert_close(cpu_kernels.ops.dequantize_weight(w, torch.float32), ref,
                                   rtol=0, atol=0)
    torch.testing.assert_close(cpu_kernels.ops.dequantize_weight(blocks, torch.bfloat16),
                               ref.bfloat16(), rtol=0, atol=0)


@pytest.mark.cpu_ops("quant_linear", "repack_gguf")
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [64, 37])
def test_k_quants_decode_within_the_int8_rounding_bound(cpu_kernels, qtype, rows, n):
    blocks, ref = k_quantized(n, 768, qtype, seed=rows)
    x = torch.randn(rows, 768)
    x[0, :32] *= 20
    bias = torch.randn(n)
    expected = x @ ref.T + bias
    bound = x_rounding_bound(x, ref) * 1.01 + 1e-4
    # random blocks' weights are far from zero-mean (the mins), so |w| sums run high against
    # the outputs: a looser check than the legacy types' 0.1, still far below the output
    assert bound.mean() < 0.3 * expected.abs().mean()
    out = cpu_kernels.ops.quant_linear(x, blocks, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()
    packed = cpu_kernels.ops.repack_gguf(blocks)
    assert torch.equal(cpu_kernels.ops.quant_linear(x, packed, bias), out)


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [9, 33])
def test_k_quants_prefill_matches_dequantize_then_matmul(cpu_kernels, qtype, rows):
    blocks, ref = k_quantized(40, 512, qtype)
    x = torch.randn(rows, 512)
    out = cpu_kernels.ops.quant_linear(x, blocks, None)
    torch.testing.assert_close(out, x @ ref.T, rtol=1e-5, atol=1e-4)


@pytest.mark.cpu_ops("quant_linear")
def test_k_quant_rows_that_are_not_whole_super_blocks_are_refused(cpu_kernels):
    with pytest.raises(RuntimeError, match=r"Q4_K \(144\), Q5_K \(176\), Q6_K \(210\)"):
        cpu_kernels.ops.quant_linear(torch.randn(1, 64), torch.zeros(4, 2, 145, dtype=torch.uint8),
                                     None)


@pytest.mark.cpu_ops("quant_linear", "quant_int8_rows", "quant_tile_rows")
def test_a_dense_twin_serves_the_rows_past_the_int8_path(cpu_kernels):
    """A tied embedding's blocks packed with the table's de-quantized values (``dense=``): up
    to the blocks' int8 rows (at most SKINNY_MAX_ROWS on AMX tiles, 256 on a full-width AVX-512
    BF16 datapath: table_int8_rows) a call streams the blocks, and on AMX tiles up to
    ``quant_tile_rows`` bf16 rows the tiles take the blocks; past them it multiplies the twin
    in the set's packed layout, instead of de-quantizing every call. A twin scaled by 2 shows
    which one a call took; the real twin gives the de-quantized product."""
    backend, ops = cpu_kernels.backend, cpu_kernels.ops
    dtype = torch.bfloat16 if cpu_kernels.isa == "avx512" else torch.float32
    blocks, ref = quantized(64, 96, QT.Q8_0, seed=5)
    table = ref.to(torch.bfloat16)  # what the loader's embedding holds: exact for Q8_0 in bf16
    packed = backend.pack_weight(blocks, dense=table)
    doubled = backend.pack_weight(blocks, dense=table * 2)
    # where oneDNN's bf16 matmuls are fast the table takes over past the decode rows (AMX
    # tiles) or 256 rows (a full-width AVX-512 BF16 datapath); elsewhere at the blocks' own
    # limit (none on VNNI: the table never takes over there, AVX2: past the decode rows)
    rows_limit = int(ops.quant_int8_rows(packed.blocks, dtype))
    limit = table_int8_rows(cpu_kernels.isa, rows_limit)
    unlimited = rows_limit == torch.iinfo(torch.int64).max  # (VNNI: quant_linear.cpp)
    if unlimited and limit == rows_limit:  # the blocks take every row count: no twin packed
        assert packed.dense is None and packed.dense_weight is None
    else:
        assert packed.int8_rows == limit and packed.dense is not None
        if cpu_kernels.isa == "avx512":  # its rows are never a decode's: no skinny layout
            assert packed.dense.skinny is None
    tiles = int(ops.quant_tile_rows(packed.blocks)) if dtype == torch.bfloat16 else 0
    edge = {limit, limit + 1} if limit < 1024 else set()  # (none on VNNI: no limit)
    for rows in sorted({1, min(limit, 40), min(limit + 1, 40), 40, 65} | edge):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = backend.linear(x, blocks, None, packed).float()
        expected = x.float() @ table.float().T
        # bf16 x, outputs rounded to bf16: a few of its steps; fp32: the int8 rounding of x
        tol = x_rounding_bound(x.float(), ref) * 1.01 + expected.abs() * 2 ** -7 + 1e-3
        assert ((out - expected).abs() <= tol).all(), (rows, (out - expected).abs().max())
        twice = backend.linear(x, blocks, None, doubled).float()
        if rows > max(limit, tiles):
            torch.testing.assert_close(twice, 2 * out, rtol=2 ** -7, atol=1e-3)
        else:
            torch.testing.assert_close(twice, out, rtol=0, atol=0)
    # a twin whose shape is not the weight's is not used
    assert backend.pack_weight(blocks, dense=table[:32]).dense is None
    # without a caller's limit: where the blocks' own has none (VNNI without AMX) no twin is
    # packed at all, else one
    from engine_worker.backends.cpu_linear import PANELS_BF16, SKINNY_BF16, GgufBlocks

    linear = SKINNY_BF16 if cpu_kernels.isa == "avx512" else PANELS_BF16
    own = GgufBlocks.of(ops, blocks, table, linear)
    assert (own.dense is None) == unlimited, rows_limit
    # an fp32 model's table (fp32 x: the blocks take the decode rows) keeps its twin on every
    # set, and serves fp32 x past them
    wide = GgufBlocks.of(ops, blocks, ref, linear)
    assert wide.dense_weight is not None
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(40))
    out = backend.linear(x, blocks, None, wide)
    torch.testing.assert_close(out, x @ ref.T, rtol=1e-4, atol=1e-4)


@pytest.mark.cpu_ops("quant_linear", "quant_int8_rows", "repack_gguf")
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q6_K], ids=lambda t: t.name)
def test_the_logits_of_decode_rows_come_back_in_fp32_before_the_bf16_rounding(cpu_kernels,
                                                                              qtype):
    """Backend.logits (the model's compute_logits): for up to SKINNY_MAX_ROWS rows the fp32
    rows of the bf16 call before its one rounding (the same bits once rounded); past them the
    linear's result widened, as compute_logits did before (a tied Q8_0 table with its dense
    twin; an untied Q6_K output weight, whose many-row calls de-quantize in the model's
    dtype, not in fp32)."""
    from engine_worker.backends.cpu_linear import SKINNY_MAX_ROWS

    backend = cpu_kernels.backend
    dtype = torch.bfloat16 if cpu_kernels.isa == "avx512" else torch.float32
    if qtype == QT.Q8_0:
        blocks, ref = quantized(64, 256, qtype, seed=7)
        packed = backend.pack_weight(blocks, dense=ref.to(torch.bfloat16))
    else:
        blocks, ref = k_quantized(64, 256, qtype, seed=7)
        packed = backend.pack_weight(blocks)
    for rows in (1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        logits = backend.logits(x, blocks, packed)
        before = backend.linear(x, blocks, None, packed).float()
        assert logits.dtype == torch.float32 and logits.shape == (rows, 64)
        if rows > SKINNY_MAX_ROWS:
            assert torch.equal(logits, before)
            continue
        assert torch.equal(logits.to(dtype).float(), before)
        # bf16: not rounded (fp32 models: the same call)
        assert torch.equal(logits, before) == (dtype == torch.float32)


@pytest.mark.cpu_ops("quant_linear", "amx_tiles", "quant_tile_rows")
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_fast_bf16_cpus_multiply_rows_past_the_decode_rows_on_a_bf16_twin(cpu_kernels, qtype):
    """Where oneDNN's bf16 matmuls outrun the int8 kernel (AMX tiles, read here from
    /proc/cpuinfo; AMD's full-width AVX-512 BF16 from Zen 5, there but for Q4_0 / Q4_1, whose
    int8 kernel is faster at every row count), a quantized layer weight is packed with its
    exact de-quantized values in oneDNN's bf16 layout: bf16 calls of up to 8 rows stream the
    blocks (the int8 kernel's result, bit for bit), more rows multiply the twin (a float
    matmul on bf16-rounded weights), except the Q4 calls that take the blocks on an AMX CPU
    (up to ``quant_tile_rows``: the int8 kernel, then the same values de-quantized into
    tiles). Elsewhere no twin is made; the twin itself is checked wherever oneDNN has bf16
    (AVX-512 BF16), built directly."""
    from engine_worker.backends.cpu_linear import GgufBlocks

    if cpu_kernels.isa != "avx512":
        pytest.skip("tile twins serve bf16 activations: the AVX-512 set's")
    backend, ops = cpu_kernels.backend, cpu_kernels.ops
    k = 512 if qtype == QT.Q4_K else 96
    blocks, ref = k_quantized(64, k, qtype, seed=7) if qtype == QT.Q4_K else \
        quantized(64, k, qtype, seed=7)
    assert (backend.pack_weight(blocks).tile_twin is not None) == \
        layer_twin_expected("avx512", qtype)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 matmul on this CPU")
    packed = GgufBlocks.with_tile_twin(ops, blocks)
    for rows in (1, 8, 9, 64, 65):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = backend.linear(x, blocks, None, packed)
        expected = x.float() @ ref.T
        assert out.shape == (rows, 64) and out.dtype == torch.bfloat16
        if rows <= 8:
            assert torch.equal(out, ops.quant_linear(x, packed.blocks, None))
        else:  # weights rounded to bf16 (2^-9 each), and a bf16 result
            bound = (x.float().abs() @ ref.abs().T) * 2 ** -8 + expected.abs() * 2 ** -8 + 1e-4
            assert ((out.float() - expected).abs() <= bound).all(), \
                (rows, (out.float() - expected).abs().max())
            direct = ops.quant_linear(x, packed.blocks, None)
            if rows <= ops.quant_tile_rows(packed.blocks):  # Q4 on AMX tiles: the blocks
                assert torch.equal(out, direct)
            elif rows <= ops.quant_int8_rows(packed.blocks, torch.bfloat16):  # int8 there
                assert not torch.equal(out, direct)


@pytest.mark.cpu_ops("quant_linear", "pack_bf16w", "linear_bf16w", "dequantize_weight")
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_avx2_stacks_of_a_bf16_model_keep_the_int8_path_or_bf16_panel_twins(cpu_kernels, qtype):
    """The AVX2 set's fused stack of a bf16 model multiplies a Q4_0 / Q4_1 / Q8_0 layer
    weight on the int8 kernel at every row count (the blocks both ways; the stack names the
    model's dtype), and a k-quant weight past 8 rows on its de-quantized bf16 panels, made
    once (what the dequantize path multiplies), instead of de-quantizing it into fp32 on every
    such call; up to 8 rows stream the blocks. An fp32 model keeps the exact de-quantized
    values (no twin); a weight the panels do not divide keeps its blocks."""
    from engine_worker.backends.base import LinearWeights

    if cpu_kernels.isa != "avx2":
        pytest.skip("panel twins are the AVX2 set's")
    backend, ops = cpu_kernels.backend, cpu_kernels.ops
    cpu_ops = backend.pack_weight.__self__
    assert cpu_ops.twins == "AVX2 bf16 panels"
    k = 512 if qtype == QT.Q4_K else 96
    blocks, ref = k_quantized(64, k, qtype, seed=3) if qtype == QT.Q4_K else \
        quantized(64, k, qtype, seed=3)
    packed = backend.pack_weight(blocks)
    lin = LinearWeights(blocks, None, packed)
    few, many = cpu_ops._stack_weights(lin, torch.float32, torch.bfloat16)
    assert few is packed.blocks
    # an fp32 model: the blocks both ways (many rows de-quantize exactly, into fp32)
    assert cpu_ops._stack_weights(lin, torch.float32, torch.float32) == (packed.blocks,
                                                                         packed.blocks)
    if qtype != QT.Q4_K:
        assert many is packed.blocks
        return
    twin = ops.pack_bf16w(ref.to(torch.bfloat16))
    # the twin holds the de-quantized weight rounded to bf16, in pack_bf16w's panels
    assert many.dtype == torch.bfloat16 and many.shape == twin.shape
    assert (many.float() - twin.float()).abs().max() <= ref.abs().max() * 2 ** -8
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    out = ops.linear_bf16w(x, many, None)
    expected = x @ ref.T
    bound = (x.abs() @ ref.abs().T) * 2 ** -8 + 1e-4  # weights rounded to bf16 (2^-9 each)
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()
    odd_blocks, _ = k_quantized(40, 512, QT.Q4_K, seed=4)  # 40 rows: no whole panels of 16
    odd = backend.pack_weight(odd_blocks)
    assert cpu_ops._stack_weights(LinearWeights(odd_blocks, None, odd), torch.float32,
                                  torch.bfloat16) == (odd.blocks, odd.blocks)


@pytest.mark.cpu_ops("quant_linear", "quant_tile_rows", "quant_tiles", "dequantize_weight",
                     "repack_gguf")
@pytest.mark.parametrize("qtype", (QT.Q4_0, QT.Q4_1), ids=lambda t: t.name)
# 24: the int8 kernel's last row count there; 25: the tiles' first (a last A tile of 9 rows,
# zero-padded); 64: four whole C tiles; 65 and 128: a second pass over the unit's B tiles;
# 129: one past them (oneDNN on the twin)
@pytest.mark.parametrize("rows", [9, 24, 25, 64, 65, 128, 129])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_rows_past_the_decode_rows_run_on_amx_tiles_where_the_cpu_has_them(
        cpu_kernels, qtype, rows, with_bias):
    """On a CPU with AMX tiles (the real AVX-512 set; /proc/cpuinfo says), a bf16 model's Q4_0
    / Q4_1 calls whose weight rows fill units of 16 take the blocks up to 128 rows (the int8
    kernel to 24, csrc/cpu/quant_linear.cpp's kTileMinRows) and from 25 to 128 run on the tiles
    (csrc/cpu/avx512/quant_amx.h): x times the bf16 twin's values (the blocks de-quantized
    bit for bit as ``dequantize_weight`` does), fp32 sums, one rounding to bf16. Turned off,
    the same call takes the int8 kernel to 64 rows, whose rounding of x gives other bits (past
    64, the de-quantized weight's matmul, which may give the tiles' bits). Elsewhere no weight
    takes the tiles."""
    ops = cpu_kernels.ops
    tiles_here = {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags() and \
        cpu_kernels.kernels.variant.name == "avx512"
    blocks = ops.repack_gguf(quantized(48, 96, qtype, seed=rows)[0])
    taken = 128 if tiles_here else 0
    on_tiles = tiles_here and 24 < rows <= taken
    assert ops.quant_tile_rows(blocks) == taken
    assert ops.quant_tile_rows(ops.repack_gguf(quantized(40, 96, qtype)[0])) == 0  # 16 + 16 + 8
    assert ops.quant_tile_rows(ops.repack_gguf(quantized(48, 96, QT.Q8_0)[0])) == 0
    twin = ops.dequantize_weight(blocks, torch.bfloat16).float()
    gen = torch.Generator().manual_seed(1000 + rows)
    x = torch.randn(rows, 96, generator=gen)
    x[-1, 32:64] *= 20  # one block with a large scale, in the last row
    x = x.to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).bfloat16() if with_bias else None  # a bf16 model's
    exact = x.float() @ twin.T + (0 if bias is None else bias.float())
    try:
        assert ops.quant_tiles(True) == tiles_here
        out = ops.quant_linear(x, blocks, bias)
        assert ops.quant_tiles(False) is False and ops.quant_tile_rows(blocks) == 0
        off = ops.quant_linear(x, blocks, bias)
    finally:
        ops.quant_tiles(True)
    assert out.shape == (rows, 48) and out.dtype == torch.bfloat16
    if on_tiles:
        # bf16 products are exact in fp32; fp32 sums of 96 of them, then one rounding to bf16
        bound = exact.abs() * 2 ** -8 + (x.float().abs() @ twin.abs().T) * 2 ** -20 + 1e-6
        assert ((out.float() - exact).abs() <= bound).all(), (out.float() - exact).abs().max()
    if not on_tiles:  # the same path both times
        assert torch.equal(out, off)
    elif rows <= 64:  # off: the int8 kernel
        assert not torch.equal(out, off)
