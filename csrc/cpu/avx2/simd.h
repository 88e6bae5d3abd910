// The AVX2 + FMA + F16C side of the vector layer (csrc/cpu/vec.h): one fp32 vector of 8 lanes
// and the operations the shared kernels are written against. avx512/simd.h defines the same
// names for 16 lanes; a name one side lacks is that instruction set's own (sum8 here).
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 kernels need -mavx2 -mfma -mf16c (engine_worker/ops/cpu_build.py)"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace QUIRE_NS::simd {

struct Vec {
  static constexpr int kWidth = 8;
  __m256 v;

  Vec() = default;
  Vec(__m256 x) : v(x) {}  // NOLINT: implicit from the register type on purpose

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float x) { return _mm256_set1_ps(x); }

  // Widening loads of 8 values: fp32 as is, bf16 by a 16-bit shift (it is the top half of
  // an fp32), fp16 by F16C's conversion.
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static Vec load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  // Narrowing stores, round to nearest even as torch's casts round (NaN stays a quiet NaN).
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i top = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // packus works per 128-bit lane: [t0..t3 t0..t3 | t4..t7 t4..t7]; gather quads 0 and 2
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  void store(c10::Half* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }  // a*b + c
inline Vec fms(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a.v, b.v, c.v); }  // a*b - c
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a.v, b.v); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a.v, b.v); }

// 1 / x to about 2^-22 relative: rcp's 12-bit estimate and one Newton step, where a division
// costs several cycles a vector. x finite and nonzero (an infinite x gives a NaN).
inline Vec reciprocal(Vec x) {
  const __m256 r = _mm256_rcp_ps(x.v);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(x.v, r, _mm256_set1_ps(2.f)));
}

inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Bit i set where lane i of a equals lane i of b (a NaN equals nothing), where it is a NaN.
inline unsigned equal_lanes(Vec a, Vec b) {
  return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)));
}
inline unsigned nan_lanes(Vec a) {
  return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)));
}

// Lanes of v where z >= bound, 0 elsewhere (and where z is a NaN).
inline Vec where_at_least(Vec z, float bound, Vec v) {
  return _mm256_and_ps(_mm256_cmp_ps(z.v, _mm256_set1_ps(bound), _CMP_GE_OQ), v.v);
}

// Lane i: the sum of a[i]'s lanes. Eight horizontal sums sharing one shuffle tree.
inline Vec sum8(const Vec* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  // per 128-bit lane: [a0 a1 a2 a3] (u0) and [a4 a5 a6 a7] (u1), low and high halves apart
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane i of the result: the sum of a_i's lanes (four horizontal sums, one shuffle tree).
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // per 128-bit lane: [a0 a1 a2 a3], each the sum of that half's four lanes
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Lanes [0, n) of x, the others `fill` (n clamped to 0..8).
inline Vec first_n(Vec x, int n, float fill) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), x.v, live);
}

// exp(x): 2^n * p(r), |r| <= ln2 / 2, degree-6 polynomial (relative error about 2e-7).
// Inputs are clamped to [-87, 88], where 2^n stays a normal number: exp(-inf) gives about
// 1.6e-38 (softmax masks such lanes itself) and large inputs a finite 1.7e38.
inline Vec exp(Vec xv) {
  const __m256 x = _mm256_min_ps(_mm256_max_ps(xv.v, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// x narrowed to T as torch's casts narrow it, subnormals included: the cache write's rounding.
// The stores above already do exactly that.
template <typename T>
inline void store_as_torch(Vec x, T* p) {
  x.store(p);
}

}  // namespace QUIRE_NS::simd
