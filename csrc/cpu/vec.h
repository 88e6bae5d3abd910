// AVX-512 helpers shared by the CPU kernels: fp32 widening and narrowing of bf16 / fp16 / fp32
// rows, a vector exp, and the per-chunk step of an online softmax. The build compiles these
// sources (the avx512 variant) with explicit -mavx512f/bw/vl/dq/bf16 flags on any x86 host
// (engine_worker/ops/cpu_build.py); the engine loads the result only on a CPU that has them.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace quire::vec {

// Widen n values (n a multiple of 16) to fp32.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    __m512 x;
    if constexpr (std::is_same_v<T, float>) {
      x = _mm512_loadu_ps(src + i);
    } else if constexpr (std::is_same_v<T, at::BFloat16>) {
      // bf16 is the top half of an fp32: widen to 32 bits and shift into place
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      static_assert(std::is_same_v<T, at::Half>);
      x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    }
    _mm512_storeu_ps(dst + i, x);
  }
}

// Narrow 16 fp32 values to T with round-to-nearest-even, as torch's own casts do.
template <typename T>
inline void store16(__m512 x, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, x);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
#ifdef __AVX512BF16__
    __m256bh packed = _mm512_cvtneps_pbh(x);
    std::memcpy(dst, &packed, 32);
#else
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, x);
    for (int i = 0; i < 16; ++i) dst[i] = at::BFloat16(tmp[i]);
#endif
  } else {
    static_assert(std::is_same_v<T, at::Half>);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

inline void scale(float* x, float factor, int64_t n) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
}

template <typename T>
inline void store_scaled(const float* x, float factor, T* dst, int64_t n) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += 16) store16(_mm512_mul_ps(_mm512_loadu_ps(x + i), f), dst + i);
}

// exp(x) for x <= 0 (softmax inputs after the max is taken off): 2^n * p(r), |r| <= ln2 / 2,
// with a degree-6 polynomial; relative error about 2e-7. Large negative inputs give 0.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums sharing one shuffle tree.
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // each 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of one query row (fp32, [d]) against 16 key rows (fp32, [16, d], all finite); lanes
// at or past `visible` are -inf.
inline __m512 dots16(const float* q, const float* k, int visible, int64_t d) {
  __m512 s = _mm512_setzero_ps();
  for (int j = 0; j < 16; j += 4) {  // four keys per pass share each load of q
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + c);
      a0 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + (j + 0) * d + c), a0);
      a1 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + (j + 1) * d + c), a1);
      a2 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + (j + 2) * d + c), a2);
      a3 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + (j + 3) * d + c), a3);
    }
    const __m128 sums = sum4(a0, a1, a2, a3);
    switch (j) {  // the lane index of an insert must be a constant
      case 0: s = _mm512_insertf32x4(s, sums, 0); break;
      case 4: s = _mm512_insertf32x4(s, sums, 1); break;
      case 8: s = _mm512_insertf32x4(s, sums, 2); break;
      default: s = _mm512_insertf32x4(s, sums, 3); break;
    }
  }
  const __mmask16 live = __mmask16((1u << visible) - 1u);
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
}

// Scores of RB query rows (fp32, [RB, d]) against 16 keys stored transposed (kT: [d, 16]):
// one zmm per row, no horizontal sums. Two accumulators per row hide the FMA latency.
template <int RB>
inline void dots16_transposed(const float* q, const float* kT, int64_t d, __m512 (&s)[RB]) {
  __m512 even[RB], odd[RB];
  for (int r = 0; r < RB; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 2) {
    const __m512 k0 = _mm512_loadu_ps(kT + c * 16), k1 = _mm512_loadu_ps(kT + (c + 1) * 16);
    for (int r = 0; r < RB; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + c]), k0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + c + 1]), k1, odd[r]);
    }
  }
  for (int r = 0; r < RB; ++r) s[r] = _mm512_add_ps(even[r], odd[r]);
}

// Softmax bookkeeping of one row for one chunk: returns exp(s - m_new) (0 where masked) and
// updates m and l; alpha receives exp(m_old - m_new), the factor for what was accumulated.
inline __m512 softmax_weights(__m512 s, __mmask16 live, float& m, float& l, float& alpha) {
  s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
  const float m_new = std::max(m, _mm512_reduce_max_ps(s));
  alpha = std::exp(m - m_new);  // 0 on the first chunk (m = -inf)
  const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  l = l * alpha + _mm512_reduce_add_ps(p);
  m = m_new;
  return p;
}

// acc[r] = alpha[r] * acc[r] + p[r] @ V for RB rows; V is [count, d] fp32.
template <int RB>
inline void accumulate_pv(const __m512 (&p)[RB], const float (&alpha)[RB], const float* v,
                          int count, int64_t d, float* acc) {
  alignas(64) float pj[RB][16];
  for (int r = 0; r < RB; ++r) _mm512_store_ps(pj[r], p[r]);
  for (int64_t c = 0; c < d; c += 16) {
    __m512 o[RB];
    for (int r = 0; r < RB; ++r)
      o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + c), _mm512_set1_ps(alpha[r]));
    for (int j = 0; j < count; ++j) {
      const __m512 vj = _mm512_loadu_ps(v + j * d + c);
      for (int r = 0; r < RB; ++r) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(pj[r][j]), vj, o[r]);
    }
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(acc + r * d + c, o[r]);
  }
}

}  // namespace quire::vec
