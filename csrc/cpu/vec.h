// The vector layer every kernel source is written against: one fp32 vector type, `Vec`, with
// kWidth lanes, widening loads and narrowing stores of fp32 / bf16 / fp16 rows, fma, exp,
// reductions and lane masks. The build compiles the sources once per instruction set and says
// which with a define (engine_worker/ops/cpu_build.py):
//
//   -DQUIRE_ISA_AVX512   avx512/simd.h   16 lanes (AVX-512 F/BW/VL/DQ + BF16)
//   -DQUIRE_ISA_AVX2     avx2/simd.h      8 lanes (AVX2 + FMA + F16C)
//
// Below the selection: what is built on `Vec` alone, the same for every instruction set.
// Everything lives in the namespace QUIRE_NS (also set by the build): two variants loaded into
// one process (the AVX2 set tested on an AVX-512 machine) must not resolve each other's symbols.
#pragma once

#ifndef QUIRE_NS
#error "QUIRE_NS (the op namespace) is set by the build: see engine_worker/ops/cpu_build.py"
#endif

#if defined(QUIRE_ISA_AVX512)
#include "avx512/simd.h"
#elif defined(QUIRE_ISA_AVX2)
#include "avx2/simd.h"
#else
#error "no instruction set: the build defines QUIRE_ISA_AVX512 or QUIRE_ISA_AVX2"
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace QUIRE_NS {

using simd::Vec;

// Ask for the cache lines of [p, p + bytes) ahead of their use (into L1; a prefetch never
// faults, so the range may run past the end of a tensor).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

namespace simd {

// Lane-wise arithmetic on the register itself (GCC's and Clang's vector extensions): what the
// intrinsics _mm256_add_ps, _mm512_add_ps, ... expand to.
inline Vec operator+(Vec a, Vec b) { return a.v + b.v; }
inline Vec operator-(Vec a, Vec b) { return a.v - b.v; }
inline Vec operator*(Vec a, Vec b) { return a.v * b.v; }
inline Vec operator/(Vec a, Vec b) { return a.v / b.v; }

// x rounded to T and back: the rounding a PyTorch op in dtype T applies to its result.
template <typename T>
inline Vec round_as(Vec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
#if defined(QUIRE_ISA_AVX512)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return simd::round_bf16(x);
#endif
  } else {
    alignas(64) T tmp[Vec::kWidth];
    x.store(tmp);
    return Vec::load(tmp);
  }
}

// exp(x) for one float through the vector exp (x <= 0; -inf gives about 1e-38, which the
// callers multiply into sums and accumulators that are still 0): std::exp is a call into libm,
// and a call in a kernel's inner loop spills every vector register the loop keeps live (on
// the 2-core Zen 4, bf16 decode attention, 64 decodes of 192 keys in cache, 30 layers: 9.9-
// 16.8 ms with the call, 8.9-9.1 without it and with decode_bf16.h's spread prefetches,
// runs alternating; scripts/decode_attention_tiles.py).
inline float exp_scalar(float x) {
  alignas(64) float lanes[Vec::kWidth];
  exp(Vec::broadcast(x)).store(lanes);
  return lanes[0];
}

// The online-softmax step of one query row for one chunk of scores s (NV vectors; lanes
// [0, visible) live, visible >= 1): p receives exp(s - m_new), 0 where masked; the running
// max m and sum l are updated; returns exp(m_old - m_new), the factor for what the row has
// accumulated so far (0 on its first chunk, where m is -inf).
template <int NV>
inline float softmax_step(const Vec (&s)[NV], int visible, float& m, float& l, Vec (&p)[NV]) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  Vec live[NV];
  Vec top = live[0] = first_n(s[0], visible, kNegInf);
  for (int i = 1; i < NV; ++i) {
    live[i] = first_n(s[i], visible - i * Vec::kWidth, kNegInf);
    top = max(top, live[i]);
  }
  const float m_new = std::max(m, reduce_max(top));
  const float alpha = exp_scalar(m - m_new);
  const Vec mv = Vec::broadcast(m_new);
  Vec sum = p[0] = first_n(exp(live[0] - mv), visible, 0.f);
  for (int i = 1; i < NV; ++i) {
    p[i] = first_n(exp(live[i] - mv), visible - i * Vec::kWidth, 0.f);
    sum = sum + p[i];
  }
  l = l * alpha + reduce_add(sum);
  m = m_new;
  return alpha;
}

}  // namespace simd
}  // namespace QUIRE_NS
