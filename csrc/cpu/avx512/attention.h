// What AVX-512 brings to the paged-attention kernel (paged_attention.cpp): the prefill dot
// products of its fp32 path, and for bf16 queries and caches its own kernels, which never
// widen the cache (AVX-512 BF16 dot products: decode_bf16.h, prefill_bf16.h).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "decode_amx.h"
#include "decode_bf16.h"
#include "paged_attention.h"
#include "prefill_amx.h"
#include "prefill_bf16.h"
#include "vec.h"

namespace QUIRE_NS {

// The most K/V bytes the layer stack prefetches for the next layer (llama_block.cpp): what
// still fits in the L2 of the AVX-512 parts it was measured on.
constexpr int64_t kPrefetchKvMaxBytes = 1 << 20;

// Scores of RB query rows (fp32, [RB, d]) against 16 keys stored transposed (kT: [d, 16]):
// one zmm per row, no horizontal sums. Two accumulators per row hide the FMA latency.
template <int RB>
inline void dots16_transposed(const float* q, const float* kT, int64_t d, Vec (&s)[RB][1]) {
  __m512 even[RB], odd[RB];
  for (int r = 0; r < RB; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 2) {
    const __m512 k0 = _mm512_loadu_ps(kT + c * 16), k1 = _mm512_loadu_ps(kT + (c + 1) * 16);
    for (int r = 0; r < RB; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + c]), k0, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + c + 1]), k1, odd[r]);
    }
  }
  for (int r = 0; r < RB; ++r) s[r][0] = _mm512_add_ps(even[r], odd[r]);
}

// Query positions per prefill work item of bf16 attention: 128 on AMX tiles and on the
// vectors alike (packing the keys an item sees is a large share of its work); `fallback` is
// the fp32 kernels' count, which this set's bf16 kernels never take.
inline int64_t prefill_positions_per_item(int64_t head_dim, int64_t fallback) {
#if defined(QUIRE_AMX_ATTENTION)
  if (prefill_amx::takes(head_dim)) return prefill_amx::kPositionsPerItem;
#endif
  (void)fallback;
  return prefill_bf16::kPositionsPerItem;
}

// Whether prefill attention runs on AMX tiles here; `want` turns that on or off (it stays
// off where the CPU has no tiles).
inline bool attention_tiles(std::optional<bool> want) {
#if defined(QUIRE_AMX_ATTENTION)
  if (want.has_value()) prefill_amx::wanted().store(*want);
  return prefill_amx::enabled();
#else
  (void)want;
  return false;
#endif
}

// Whether attend_item_native takes items of these dtypes and shape.
template <typename TQ, typename TKV>
bool native_decode(int64_t head_dim, int64_t group) {
  return std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TKV, at::BFloat16> &&
         head_dim % 32 == 0 && head_dim <= 256 && group <= decode_bf16::kMaxGroup;
}

// The bf16 kernels for a whole work item (bf16 queries and cache, head_dim a multiple of 32 up
// to 256, at most 16 query heads per kv head); false where they do not apply, leaving the
// item to the fp32 path. A key split (it.part >= 0: one decode's kv head, make_items) leaves
// its rows' state in part it.part of `parts` for merge_parts, as the fp32 path does.
template <typename TQ, typename TKV>
bool attend_item_native(const Item& it, const TQ* q, TQ* out, const Layout<TKV>& lay,
                        const int32_t* table, int64_t num_heads, int64_t first_pos,
                        float scale, float* parts) {
  if constexpr (std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TKV, at::BFloat16>) {
    const int64_t d = lay.head_dim, group = num_heads / lay.num_kv_heads;
    if (!native_decode<TQ, TKV>(d, group)) return false;
    const int64_t num_pos = it.row_end - it.row_begin;
    const int64_t last_pos = first_pos + num_pos - 1;
    const bool split = it.part >= 0;
    const int64_t key_begin = split ? it.key_begin : 0;
    const int64_t key_end = split ? std::min(last_pos + 1, it.key_end) : last_pos + 1;
    // each key's slot, once for all kv heads
    thread_local std::vector<int64_t> offsets;
    offsets.resize(key_end);
    for (int64_t p = key_begin; p < key_end; ++p) offsets[p] = lay.offset(table, 0, p);
    if (split) {
      const int64_t row = (it.row_begin * num_heads + it.kv_begin * group) * d;
      decode_bf16::dispatch(q + row, nullptr, int(group), d, 1, key_end, scale,
                            lay.key_cache + it.kv_begin * d, lay.value_cache + it.kv_begin * d,
                            offsets.data(), key_begin, key_end,
                            parts + it.part * group * (d + 2));
      return true;
    }
    for (int64_t kv_head = it.kv_begin; kv_head < it.kv_end; ++kv_head) {
      const TKV* keys = lay.key_cache + kv_head * d;
      const TKV* values = lay.value_cache + kv_head * d;
      const int64_t row = (it.row_begin * num_heads + kv_head * group) * d;
      if (num_pos == 1) {  // a decode: every kv head of the item in one walk of the keys
#if defined(QUIRE_AMX_ATTENTION)
        if (decode_amx::takes(group, d)) {
          decode_amx::dispatch(q + row, out + row, int(group), d, int(it.kv_end - kv_head),
                               last_pos + 1, scale, keys, values, offsets.data());
          break;
        }
#endif
        decode_bf16::dispatch(q + row, out + row, int(group), d, int(it.kv_end - kv_head),
                              last_pos + 1, scale, keys, values, offsets.data());
        break;
      }
      // row (i, g): query position i of the tile, head g of the group
      auto at = [&](auto* base) {
        return [=](int64_t i, int64_t g) { return base + row + (i * num_heads + g) * d; };
      };
#if defined(QUIRE_AMX_ATTENTION)
      if (prefill_amx::takes(d)) {
        prefill_amx::attend_tile(at(q), at(out), num_pos, group, d, first_pos, scale, keys,
                                 values, offsets.data());
        continue;
      }
#endif
      prefill_bf16::attend_tile(at(q), at(out), num_pos, group, d, first_pos, scale, keys,
                                values, offsets.data());
    }
    return true;
  }
  return false;
}

}  // namespace QUIRE_NS
