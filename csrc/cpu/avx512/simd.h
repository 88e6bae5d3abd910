// The AVX-512 side of the vector layer (csrc/cpu/vec.h): one fp32 vector of 16 lanes and the
// operations the shared kernels are written against. avx2/simd.h defines the same names for 8
// lanes; a name one side lacks is that instruction set's own (sum4 here).
//
// The library is compiled with explicit -mavx512f/bw/vl/dq/bf16 flags on any x86 host
// (engine_worker/ops/cpu_build.py); the engine loads it only on a CPU that has them.
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__) || !defined(__AVX512BF16__)
#error "the avx512 kernels need -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace QUIRE_NS::simd {

struct Vec {
  static constexpr int kWidth = 16;
  __m512 v;

  Vec() = default;
  Vec(__m512 x) : v(x) {}  // NOLINT: implicit from the register type on purpose

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float x) { return _mm512_set1_ps(x); }

  // Widening loads of 16 values: fp32 as is, bf16 by a 16-bit shift (it is the top half of
  // an fp32), fp16 by the hardware conversion.
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static Vec load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // Narrowing stores, round to nearest even as torch's casts round; bf16 by vcvtneps2bf16,
  // which flushes subnormal results to zero (store_as_torch keeps them).
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {
    const __m256bh packed = _mm512_cvtneps_pbh(v);
    std::memcpy(p, &packed, 32);
  }
  void store(c10::Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// x rounded to bf16 and widened back, in registers (vec.h's round_as)
inline Vec round_bf16(Vec x) {
  const __m256bh packed = _mm512_cvtneps_pbh(x.v);
  __m256i raw;
  std::memcpy(&raw, &packed, 32);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }  // a*b + c
inline Vec fms(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a.v, b.v, c.v); }  // a*b - c
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a.v, b.v); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a.v, b.v); }

// 1 / x to about 2^-22 relative: rcp14's estimate and one Newton step, where a division costs
// about 10 cycles a vector. x finite and nonzero (an infinite x gives a NaN).
inline Vec reciprocal(Vec x) {
  const __m512 r = _mm512_rcp14_ps(x.v);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x.v, r, _mm512_set1_ps(2.f)));
}

inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }

// Bit i set where lane i of a equals lane i of b (a NaN equals nothing), where it is a NaN.
inline unsigned equal_lanes(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline unsigned nan_lanes(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }

// Lanes of v where z >= bound, 0 elsewhere (and where z is a NaN).
inline Vec where_at_least(Vec z, float bound, Vec v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z.v, _mm512_set1_ps(bound), _CMP_GE_OQ), v.v);
}

// The mask of lanes [0, n), n clamped to 0..16.
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}

// Lanes [0, n) of x, the others `fill` (n clamped to 0..16).
inline Vec first_n(Vec x, int n, float fill) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), lanes_below(n), x.v);
}

// exp(x) for x <= 0 (softmax inputs after the max is taken off): 2^n * p(r), |r| <= ln2 / 2,
// with a degree-6 polynomial; relative error about 2e-7. Inputs below -86.6 give about 1e-38,
// the smallest normal floats, never a subnormal: on Intel cores a subnormal result costs a
// microcode assist (a hundred cycles or more), and the masked lanes of every softmax land here.
inline Vec exp(Vec xv) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 x = _mm512_max_ps(xv.v, _mm512_set1_ps(-86.6f));
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

// 2^t for t <= 0 (or a little above, where a softmax lets its reference lag the maximum):
// 2^round(t) times a degree-4 polynomial of the rest (|f| <= 1/2), relative
// error under 5e-5, well inside the bf16 rounding the probabilities get. Below -125 (-inf
// included) it gives 2^-125, never a subnormal (a microcode assist each on Intel cores): the
// callers mask what must be 0.
inline __m512 exp2_neg(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
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

// x narrowed to T as torch's casts narrow it, subnormals included: the cache write's rounding.
// vcvtneps2bf16 flushes bf16 subnormals, so bf16 goes through c10's scalar rounding (a cache
// write is a few rows a step); fp16's conversion keeps them.
template <typename T>
inline void store_as_torch(Vec x, T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, x.v);
    for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(tmp[i]);
  } else {
    x.store(p);
  }
}

}  // namespace QUIRE_NS::simd
