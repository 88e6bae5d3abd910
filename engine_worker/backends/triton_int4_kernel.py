"""The Triton 4-bit linear kernel: out[M, N] = x[M, K] @ W^T with W in the int4 group layout
of ``weights.int4_layouts`` (AWQ / GPTQ weights repacked at load), de-quantized in registers.

Layout (int32 [N, G, WORDS], WORDS = GROUP / 8 + 1): for output row n and group g, GROUP / 8
words of codes in input order (code i of a word at bits 4i), then a header word: the group's
fp16 scale in bits 0..15 and its zero point in bits 16..23.

Each program owns a [BLOCK_M, BLOCK_N] tile of out (computed as its transpose, so that the
weight tile is read as stored: each output row's words contiguous) and walks K in steps of
BLOCK_K, which divides GROUP, so a step lies in one group: the step's codes minus the zero
point are small integers (-16..15, exact in fp16 / bf16), multiplied by x with ``tl.dot``, and
the partial sum is scaled once by the group's scale in fp32. The weights are thus exact; the
only rounding is x's own dtype and the fp32 accumulation (fp32 x: IEEE dots, never TF32).

Imported only where Triton runs (a CUDA device, or ``TRITON_INTERPRET=1`` set before import).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    WORDS: tl.constexpr = GROUP // 8 + 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    m_ok = offs_m < M
    n_ok = offs_n < N
    row_words = (K // GROUP) * WORDS  # words of one output row
    # [BLOCK_N] start of each row's words; int64: N * row_words can pass 2^31
    w_rows = w_ptr + offs_n.to(tl.int64) * row_words
    # the tile is computed transposed, out^T [BLOCK_N, BLOCK_M]: the weight tile is then
    # loaded as stored (each row's words contiguous) and x's small tile is the one turned
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP
        word0 = group * WORDS + (k0 % GROUP) // 8
        # x^T: [BLOCK_K, BLOCK_M]
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                     mask=m_ok[None, :], other=0.0)
        # words [BLOCK_N, BLOCK_K / 8] -> codes [BLOCK_N, BLOCK_K] in input order
        words = tl.load(w_rows[:, None] + word0 + offs_w[None, :], mask=n_ok[:, None], other=0)
        codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF,
                           (BLOCK_N, BLOCK_K))
        header = tl.load(w_rows + group * WORDS + GROUP // 8, mask=n_ok, other=0)  # [BLOCK_N]
        zero = (header >> 16) & 0xFF
        scale = (header & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        w = (codes - zero[:, None]).to(xt.dtype)  # small integers: exact in any float type
        if IEEE:
            part = tl.dot(w, xt, input_precision="ieee")
        else:
            part = tl.dot(w, xt)
        acc += part * scale[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def int4_dequantize_kernel(w_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """The whole weight de-quantized into out [N, K] (its dtype): for many rows, where cuBLAS
    on the dense weight beats the fused kernel's tiles (see ``triton_int4.DENSE_ROWS``)."""
    WORDS: tl.constexpr = GROUP // 8 + 1
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * ((K // GROUP) * WORDS)
    group = k0 // GROUP
    words = tl.load(w_rows[:, None] + group * WORDS + (k0 % GROUP) // 8 + offs_w[None, :],
                    mask=n_ok[:, None], other=0)
    codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    header = tl.load(w_rows + group * WORDS + GROUP // 8, mask=n_ok, other=0)
    zero = (header >> 16) & 0xFF
    scale = (header & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    w = (codes - zero[:, None]).to(tl.float32) * scale[:, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])
