// The AVX-512 kernel set compiled for an AVX2 CPU, for tests only: every _mm512_* intrinsic is
// SIMDe's portable implementation (https://github.com/simd-everywhere/simde, the simde-py
// package), so the avx512 sources (csrc/cpu/*.cpp with avx512/*) run, slowly, on a CPU without
// AVX-512 and the kernel tests check their numerics on either machine type. The build passes
// this file with `-include` (the `avx512_emulated` variant, defined in tests/conftest.py); the
// engine never selects the result.
//
// Order matters: the compiler's own intrinsics first (their declarations must not be renamed),
// then SIMDe with native aliases (`_mm512_add_ps` -> `simde_mm512_add_ps`, SIMDe seeing no
// AVX-512), then the few intrinsics SIMDe 0.8.2 lacks, then the feature macros the avx512
// sources require, which SIMDe must not see.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace quire_avx512_emulation {

// fp32 -> bf16, round to nearest even, subnormals flushed and NaN kept quiet: what
// vcvtneps2bf16 does.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline simde__m256bh cvtneps_pbh(simde__m512 a) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, a);
  alignas(32) uint16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = to_bf16(f[i]);
  simde__m256bh r;
  std::memcpy(&r, h, sizeof(r));
  return r;
}

// bf16 of b in the low 16 lanes, of a in the high 16, as vcvtne2ps2bf16 orders them
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  alignas(64) float f[32];
  simde_mm512_store_ps(f, b);
  simde_mm512_store_ps(f + 16, a);
  alignas(64) uint16_t h[32];
  for (int i = 0; i < 32; ++i) h[i] = to_bf16(f[i]);
  simde__m512bh r;
  std::memcpy(&r, h, sizeof(r));
  return r;
}

// a tree of halves, as GCC's _mm512_reduce_add_ps sums
inline float reduce_add_ps(simde__m512 a) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, a);
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) f[i] += f[i + width];
  return f[0];
}

// round to nearest even: the one rounding the sources ask for
inline simde__m256i cvtps_ph(simde__m512 a) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, a);
  alignas(32) uint16_t h[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(h),
                  _mm256_cvtps_ph(_mm256_load_ps(f), _MM_FROUND_TO_NEAREST_INT));
  _mm_store_si128(reinterpret_cast<__m128i*>(h + 8),
                  _mm256_cvtps_ph(_mm256_load_ps(f + 8), _MM_FROUND_TO_NEAREST_INT));
  simde__m256i r;
  std::memcpy(&r, h, sizeof(r));
  return r;
}

}  // namespace quire_avx512_emulation

#define _mm512_cvtneps_pbh(a) quire_avx512_emulation::cvtneps_pbh(a)
#define _mm512_cvtne2ps_pbh(a, b) quire_avx512_emulation::cvtne2ps_pbh(a, b)
#define _mm512_reduce_add_ps(a) quire_avx512_emulation::reduce_add_ps(a)
#define _mm512_cvtps_ph(a, rounding) quire_avx512_emulation::cvtps_ph(a)

#define QUIRE_AVX512_EMULATED 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define __AVX512BF16__ 1
#define __AVX512VNNI__ 1
