// What AVX2 brings to the paged-attention kernel (paged_attention.cpp): the prefill dot
// products of its fp32 path. It has no attention kernel of its own besides.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

#include "paged_attention.h"
#include "vec.h"

namespace QUIRE_NS {

// The most K/V bytes the layer stack prefetches for the next layer (llama_block.cpp): what
// still fits in a Zen 3 core's 512 KiB L2.
constexpr int64_t kPrefetchKvMaxBytes = 1 << 19;

// Scores of RB query rows (fp32, [RB, d]) against 16 keys stored transposed (kT: [d, 16]): a
// broadcast query element times 16 keys per two FMAs, no horizontal sums.
template <int RB>
inline void dots16_transposed(const float* q, const float* kT, int64_t d, Vec (&s)[RB][2]) {
  for (int r = 0; r < RB; ++r) s[r][0] = s[r][1] = Vec::zero();
  for (int64_t c = 0; c < d; ++c) {
    const Vec k0 = Vec::load(kT + c * 16), k1 = Vec::load(kT + c * 16 + 8);
    for (int r = 0; r < RB; ++r) {
      const Vec qb = Vec::broadcast(q[r * d + c]);
      s[r][0] = simd::fma(qb, k0, s[r][0]);
      s[r][1] = simd::fma(qb, k1, s[r][1]);
    }
  }
}

inline int64_t prefill_positions_per_item(int64_t, int64_t fallback) { return fallback; }

inline bool attention_tiles(std::optional<bool>) { return false; }

// No kernel of its own: every item takes the fp32 path.
template <typename TQ, typename TKV>
bool attend_item_native(const Item&, const TQ*, TQ*, const Layout<TKV>&, const int32_t*,
                        int64_t, int64_t, float, float*) {
  return false;
}

}  // namespace QUIRE_NS
