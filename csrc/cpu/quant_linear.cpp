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

// R weight rows (row_bytes apart) dotted with one quantized row of x: out[0 .. R).
template <QType T, int R>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const int8_t* xq,
                     const float* xd, const float* xdsum, float* out) {
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.f;
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * kBytes<T>;
      const float d = half_at(blk);
      __m256 dot;
      if constexpr (T == QType::kQ8_0) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        // signed x signed through maddubs: |q| times y with q's sign
        dot = dot_u8_i8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
      } else if constexpr (T == QType::kQ4_1) {
        dot = dot_u8_i8(nibbles(blk + 4), y);
        offset[r] += half_at(blk + 2) * xdsum[b];
      } else {
        dot = dot_u8_i8(nibbles(blk + 2), y);
        offset[r] -= 8.f * d * xdsum[b];
      }
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offset[r];
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

// One block's 32 weights as fp32 into out[0 .. 32).
template <QType T>
inline void dequant_block(const uint8_t* blk, float* out) {
  const float d = half_at(blk);
  __m256i bytes;
  if constexpr (T == QType::kQ8_0) {
    bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    bytes = nibbles(blk + (T == QType::kQ4_1 ? 4 : 2));
  }
  const float offset = T == QType::kQ4_1 ? half_at(blk + 2) : T == QType::kQ4_0 ? -8.f * d : 0.f;
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
  const int64_t num_blocks = K / kBlock;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float tmp[kBlock];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < num_blocks; ++b) {
        dequant_block<T>(w + (n * num_blocks + b) * kBytes<T>, tmp);
        O* o = out + n * K + b * kBlock;
        if constexpr (std::is_same_v<O, float>) {
          std::memcpy(o, tmp, sizeof(tmp));
        } else {
          for (int j = 0; j < kBlock; j += Vec::kWidth) Vec::load(tmp + j).store(o + j);
        }
      }
  });
}

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous(), name,
              ": a quantized weight is contiguous uint8 [N, K / 32, block bytes]");
  qtype_of(w.size(2));
}

}  // namespace

bool is_quantized_weight(const at::Tensor& w) {
  return w.scalar_type() == at::kByte && w.dim() == 3;
}

at::Tensor dequantize_weight(const at::Tensor& w, at::ScalarType dtype) {
  check_weight(w, "dequantize_weight");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_weight: into fp32 or bf16");
  const int64_t N = w.size(0), K = w.size(1) * kBlock;
  at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  with_qtype(qtype_of(w.size(2)), [&](auto t) {
    constexpr QType T = decltype(t)::value;
    if (dtype == at::kFloat)
      dequantize_into<T>(wp, N, K, out.data_ptr<float>());
    else
      dequantize_into<T>(wp, N, K, out.data_ptr<at::BFloat16>());
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  check_weight(w, "quant_linear");
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
  const uint8_t* wp = w.data_ptr<uint8_t>();
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
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
}

}  // namespace QUIRE_NS
