// Linear layers over GGUF's legacy block-quantized weights, kept as the file stores them:
//   out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias), x and out fp32 or bf16.
//
// A weight is uint8 [N, K / 32, block_bytes]: row n's blocks of 32 weights in order, each block
// exactly as ggml lays it out, and block_bytes names the type (no other field is needed):
//   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles       w = d * (q - 8),  q in 0..15
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes nibbles  w = d * q + m,    q in 0..15
//   Q8_0 (34 bytes): fp16 d, 32 int8                   w = d * q
// Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
//
// Repacked (repack_gguf, once at load; int8 [N, K / 32, block_bytes], the same bytes a row,
// regrouped): row n is [d of every block (fp16)] [m of every block (Q4_1)] [every block's
// quants]. Eight blocks' scales then come in one load and one conversion, and each block's
// inner loop is only its quants: about half the instructions a block of the file's layout
// takes (what decode costs where the cores, not memory, are the limit). Either layout is
// taken; the file's is repacked on the fly (tests), the loader's weights come repacked.
//
// Few rows (decode, M <= kDecodeRows): bound by the bytes of weight streamed, so the weight is
// read as it is (4.5 to 8.5 bits a weight instead of 16) and never widened to floats. Each row of
// x is quantized to int8 per block of 32 as ggml's Q8_0 (d_x = max|x| / 127, x ~ d_x * q_x,
// round to nearest even), and every block is an integer dot product (maddubs + madd, exact in
// int32) scaled once: sum_blocks d_w d_x (q_w . q_x) (+ m_w d_x sum(q_x) for Q4_1, - 8 d_w ...
// for Q4_0). The only error against de-quantize-then-matmul in fp32 is x's rounding to int8:
// |out - ref| <= sum_k |w_k| d_x(k) / 2 (plus fp32 summation order); tests check that bound.
// Threads split the output rows; a thread reads its rows' bytes once for all M rows of x.
//
// More rows (prefill): compute-bound, so the weight is de-quantized into x's dtype (all of it,
// one pass, parallel over rows: a small fraction of the matmul's time for M in the tens) and
// the matmul is torch's (oneDNN) on that.
//
// The integer dot products are AVX2 (256-bit), which both kernel sets have (the AVX-512 set is
// built with -mavx2); the float side goes through the vector layer (vec.h).
//
// References: gguf.quants.dequantize (the format), then x @ w.T in fp32; tests compare.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kDecodeRows = 4;  // up to here: int8 dot products on the weight as stored

enum class QType { kQ4_0, kQ4_1, kQ8_0 };

QType qtype_of(int64_t block_bytes) {
  switch (block_bytes) {
    case 18: return QType::kQ4_0;
    case 20: return QType::kQ4_1;
    case 34: return QType::kQ8_0;
    default:
      TORCH_CHECK(false, "quantized weight: blocks of ", block_bytes,
                  " bytes are none of Q4_0 (18), Q4_1 (20), Q8_0 (34)");
  }
}

// f(std::integral_constant<QType, T>{}) for the weight's type: the kernels unroll over it.
template <typename F>
void with_qtype(QType t, F f) {
  switch (t) {
    case QType::kQ4_0: f(std::integral_constant<QType, QType::kQ4_0>{}); break;
    case QType::kQ4_1: f(std::integral_constant<QType, QType::kQ4_1>{}); break;
    case QType::kQ8_0: f(std::integral_constant<QType, QType::kQ8_0>{}); break;
  }
}

template <QType T>
constexpr int64_t kBytes = T == QType::kQ4_0 ? 18 : T == QType::kQ4_1 ? 20 : 34;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// The 32 nibbles of a Q4 block as bytes 0..15, in weight order.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 8 int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes), as floats: exact, each
// pair's sum is at most 2 * 128 * 127 in magnitude (maddubs saturates only past 32767).
inline __m256 dot_u8_i8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows of x [M, K] (fp32, contiguous) as ggml's Q8_0: q [M * K] int8, and per block its scale
// d and d * sum(q) (what a Q4_1 block's offset and a Q4_0 block's -8 multiply).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t num_blocks = M * K / kBlock;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(num_blocks),
                  std::vector<float>(num_blocks)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max_abs = _mm_cvtss_f32(m);
    const float d = max_abs / 127.f;
    const __m256 inv = _mm256_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // even
    // packs work per 128-bit lane: the permute puts the 8 groups of 4 back in order
    const __m256i q16a = _mm256_packs_epi32(i[0], i[1]), q16b = _mm256_packs_epi32(i[2], i[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b * kBlock), q8);
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8),
                                           _mm256_set1_epi16(1));
    const int sum_q = int(hsum(_mm256_cvtepi32_ps(sums)));
    r.d[b] = d;
    r.dsum[b] = d * float(sum_q);
  }
  return r;
}

// Where a repacked row keeps its parts: nb blocks' scales (fp16), their offsets (Q4_1, fp16),
// then the quants, 16 (Q4) or 32 (Q8_0) bytes a block.
template <QType T>
struct RowLayout {
  static constexpr int64_t kQuantBytes = T == QType::kQ8_0 ? 32 : 16;
  static const uint8_t* scales(const uint8_t* row) { return row; }
  static const uint8_t* mins(const uint8_t* row, int64_t nb) { return row + 2 * nb; }
  static const uint8_t* quants(const uint8_t* row, int64_t nb) {
    return row + (T == QType::kQ4_1 ? 4 : 2) * nb;
  }
};

// The weights of one block's quants against x's block y, as 8 float partial sums.
template <QType T>
inline __m256 block_dot(const uint8_t* q, __m256i y) {
  if constexpr (T == QType::kQ8_0) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    // signed x signed through maddubs: |w| times y with w's sign
    return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
  } else {
    return dot_u8_i8(nibbles(q), y);  // Q4_0's -8 goes into the offsets
  }
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R repacked weight rows (row_bytes apart) dotted with one quantized row of x: out[0 .. R).
// Eight blocks at a time: their scales d_w * d_x as one vector each row (and the offsets'
// share, m_w * d_x * sum(q_x), or -8 d_w * ... for Q4_0, as one FMA), then each block's
// integer dot product times its lane of that vector.
template <QType T, int R>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xdsum, float* out) {
  using L = RowLayout<T>;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][8];
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const __m256 dx = _mm256_loadu_ps(xd + b0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = w + r * row_bytes;
      const __m256 dw = halves8(L::scales(row) + 2 * b0);
      _mm256_store_ps(scale[r], _mm256_mul_ps(dw, dx));
      if constexpr (T == QType::kQ4_1)
        off[r] = _mm256_fmadd_ps(halves8(L::mins(row, nb) + 2 * b0),
                                 _mm256_loadu_ps(xdsum + b0), off[r]);
      else if constexpr (T == QType::kQ4_0)
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(-8.f)),
                                 _mm256_loadu_ps(xdsum + b0), off[r]);
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = b0 + j;
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      for (int r = 0; r < R; ++r) {
        const __m256 dot = block_dot<T>(L::quants(w + r * row_bytes, nb) + b * L::kQuantBytes, y);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&scale[r][j]), acc[r]);
      }
    }
  }
  float tail[R] = {};
  for (; b0 < nb; ++b0) {  // the last nb % 8 blocks, one at a time
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b0 * kBlock));
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = w + r * row_bytes;
      const float d = half_at(L::scales(row) + 2 * b0);
      const __m256 dot = block_dot<T>(L::quants(row, nb) + b0 * L::kQuantBytes, y);
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[b0]), acc[r]);
      if constexpr (T == QType::kQ4_1) tail[r] += half_at(L::mins(row, nb) + 2 * b0) * xdsum[b0];
      else if constexpr (T == QType::kQ4_0) tail[r] -= 8.f * d * xdsum[b0];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + hsum(off[r]) + tail[r];
}

constexpr int kRowGroup = 4;  // weight rows sharing each load of x's block

template <QType T>
void decode_rows(const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                 float* out) {
  const int64_t num_blocks = K / kBlock, row_bytes = num_blocks * kBytes<T>;
  const int64_t num_groups = (N + kRowGroup - 1) / kRowGroup;
  at::parallel_for(0, num_groups, 8, [&](int64_t g0, int64_t g1) {
    float tmp[kRowGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * kRowGroup, rows = std::min<int64_t>(kRowGroup, N - n);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* q = xq.q.data() + m * K;
        const float* d = xq.d.data() + m * num_blocks;
        const float* ds = xq.dsum.data() + m * num_blocks;
        if (rows == kRowGroup) {
          dot_rows<T, kRowGroup>(w + n * row_bytes, row_bytes, num_blocks, q, d, ds, tmp);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            dot_rows<T, 1>(w + (n + r) * row_bytes, row_bytes, num_blocks, q, d, ds, tmp + r);
        }
        std::memcpy(out + m * N + n, tmp, rows * sizeof(float));
      }
    }
  });
}

// Block b of a repacked row (nb blocks) as fp32 into out[0 .. 32).
template <QType T>
inline void dequant_block(const uint8_t* row, int64_t nb, int64_t b, float* out) {
  using L = RowLayout<T>;
  const float d = half_at(L::scales(row) + 2 * b);
  const uint8_t* q = L::quants(row, nb) + b * L::kQuantBytes;
  const __m256i bytes = T == QType::kQ8_0
                            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                            : nibbles(q);
  const float offset = T == QType::kQ4_1   ? half_at(L::mins(row, nb) + 2 * b)
                       : T == QType::kQ4_0 ? -8.f * d
                                           : 0.f;
  const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(offset);
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = _mm_srli_si128(halves[i / 2], 8 * (i % 2));
    const __m256i wide = T == QType::kQ8_0 ? _mm256_cvtepi8_epi32(eight)
                                           : _mm256_cvtepu8_epi32(eight);
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), dv, ov));
  }
}

template <QType T, typename O>
void dequantize_into(const uint8_t* w, int64_t N, int64_t K, O* out) {
  const int64_t num_blocks = K / kBlock, row_bytes = num_blocks * kBytes<T>;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float tmp[kBlock];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < num_blocks; ++b) {
        dequant_block<T>(w + n * row_bytes, num_blocks, b, tmp);
        O* o = out + n * K + b * kBlock;
        if constexpr (std::is_same_v<O, float>) {
          std::memcpy(o, tmp, sizeof(tmp));
        } else {
          for (int j = 0; j < kBlock; j += Vec::kWidth) Vec::load(tmp + j).store(o + j);
        }
      }
  });
}

// The file's layout (uint8) regrouped row by row as RowLayout says (int8, same shape).
at::Tensor repack(const at::Tensor& w) {
  const int64_t N = w.size(0), nb = w.size(1), B = w.size(2);
  const int64_t head = B == 20 ? 4 : 2, quant_bytes = B - head;
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kChar));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = src + n * nb * B;
      uint8_t* o = dst + n * nb * B;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * B;
        std::memcpy(o + 2 * b, blk, 2);  // d
        if (head == 4) std::memcpy(o + 2 * nb + 2 * b, blk + 2, 2);  // m
        std::memcpy(o + head * nb + b * quant_bytes, blk + head, quant_bytes);
      }
    }
  });
  return out;
}

// The weight repacked: as given where it is (int8), else regrouped now (uint8, the file's).
at::Tensor repacked(const at::Tensor& w, const char* name) {
  TORCH_CHECK((w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) && w.dim() == 3 &&
                  w.is_contiguous(),
              name, ": a quantized weight is contiguous [N, K / 32, block bytes], uint8 as the "
              "GGUF file lays it out or int8 from repack_gguf");
  qtype_of(w.size(2));
  return w.scalar_type() == at::kChar ? w : repack(w);
}

}  // namespace

bool is_quantized_weight(const at::Tensor& w) {
  return (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) && w.dim() == 3;
}

at::Tensor repack_gguf(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "repack_gguf: the file's blocks, uint8");
  return repacked(w, "repack_gguf");
}

at::Tensor dequantize_weight(const at::Tensor& w_in, at::ScalarType dtype) {
  const at::Tensor w = repacked(w_in, "dequantize_weight");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_weight: into fp32 or bf16");
  const int64_t N = w.size(0), K = w.size(1) * kBlock;
  at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  with_qtype(qtype_of(w.size(2)), [&](auto t) {
    constexpr QType T = decltype(t)::value;
    if (dtype == at::kFloat)
      dequantize_into<T>(wp, N, K, out.data_ptr<float>());
    else
      dequantize_into<T>(wp, N, K, out.data_ptr<at::BFloat16>());
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w_in,
                        const std::optional<at::Tensor>& bias) {
  const at::Tensor w = repacked(w_in, "quant_linear");
  const int64_t N = w.size(0), K = w.size(1) * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be fp32 or bf16 [M, K] with the weight's K = ", K);
  const int64_t M = x.size(0);
  if (M > kDecodeRows) return at::linear(x, dequantize_weight(w, x.scalar_type()), bias);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), M, K);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  with_qtype(qtype_of(w.size(2)), [&](auto t) {
    decode_rows<decltype(t)::value>(xq, M, K, wp, N, out.data_ptr<float>());
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: bias must be [N]");
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("quant_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("dequantize_weight(Tensor w, ScalarType dtype) -> Tensor");
  m.def("repack_gguf(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
  m.impl("repack_gguf", &repack_gguf);
}

}  // namespace QUIRE_NS
