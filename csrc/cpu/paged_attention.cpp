// Paged attention: decodes and chunked prefill in one varlen kernel, and the cache write.
//
// Every sequence b owns query rows [query_start_loc[b], query_start_loc[b + 1]) of the step and
// has seq_lens[b] tokens in the cache, its new ones included. Its query row i sits at position
// seq_lens[b] - query_len + i and sees keys 0..that position, read through block_tables[b].
// A decode is the case query_len == 1; a prefill chunk with cached context is the general case.
//
// Work items are (sequence, kv heads, tile of query positions). An instruction set with a
// kernel of its own for the item's dtypes takes it (<isa>/attention.h: AVX-512 BF16's for bf16
// queries and cache); otherwise the fp32 path below: the item holds the query rows of every
// head in its GQA group in fp32, walks the keys in chunks of 16 slots, and keeps a running
// (online) softmax per row: max m, sum l, and an fp32 accumulator of P @ V.
//   decode:  few rows, so keys and values are read where they lie (widened in registers),
//            each key vector once for up to three rows of the GQA group, four keys a pass
//            sharing one horizontal-sum tree a row (dots16_rows), and each value vector once
//            for the rows, the keys outer (accumulate_decode);
//   prefill: many rows, so a chunk's keys are widened once into a transposed fp32 tile
//            ([d][16]: a broadcast query element times 16 keys, no horizontal sums) and its
//            values into fp32 rows, reused by every row of the item.
// The cache may hold fp32, bf16 or fp16 under fp32 queries (half the bytes of an fp32 cache:
// a bf16 value widens by a shift), or the queries' own dtype.
//
// The pure-PyTorch reference is engine_worker/attention/torch_backend.py; tests compare the two.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;
constexpr int kChunkVecs = kChunk / W;  // score vectors per row and chunk
constexpr int kPrefillTile = 32;        // query positions per work item in prefill (the
                                        // vector kernels'; <isa>/attention.h may take more)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One row's softmax state and output accumulator, all fp32.
struct Rows {
  float* q;    // [n, d], pre-scaled
  float* acc;  // [n, d]
  float* m;    // [n] running max
  float* l;    // [n] running sum
};

// The online-softmax step of one row (simd::softmax_step), its probabilities into p[kChunk].
inline float softmax_into(const Vec (&s)[kChunkVecs], int visible, float& m, float& l,
                          float* p) {
  Vec pv[kChunkVecs];
  const float alpha = simd::softmax_step(s, visible, m, l, pv);
  for (int i = 0; i < kChunkVecs; ++i) pv[i].store(p + i * W);
  return alpha;
}

// acc[r] = alpha[r] * acc[r] + p[r] @ V for RB rows (acc rows d apart; value j is vrow[j]) in
// columns [c0, c1), a multiple of C * W: C vectors of each row's accumulator stay in registers
// while every key passes, so a row's probability of a key is broadcast once per C vectors of V
template <int RB, int C, typename TV>
inline void accumulate_pv(const float (*p)[kChunk], const float* alpha, const TV* const* vrow,
                               int count, int64_t d, int64_t c0, int64_t c1, float* acc) {
  for (int64_t c = c0; c < c1; c += C * W) {
    Vec o[RB][C];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < C; ++i)
        o[r][i] = Vec::load(acc + r * d + c + i * W) * Vec::broadcast(alpha[r]);
    for (int j = 0; j < count; ++j) {
      Vec pj[RB];
      for (int r = 0; r < RB; ++r) pj[r] = Vec::broadcast(p[r][j]);
      for (int i = 0; i < C; ++i) {
        const Vec v = Vec::load(vrow[j] + c + i * W);
        for (int r = 0; r < RB; ++r) o[r][i] = simd::fma(pj[r], v, o[r][i]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < C; ++i) o[r][i].store(acc + r * d + c + i * W);
  }
}

// RB rows (RB <= 4): columns four vectors at a time (three rows) or two (four rows), the rest
// one at a time
template <int RB, typename TV>
inline void accumulate_decode(const float (*p)[kChunk], const float* alpha, const TV* const* vrow,
                              int count, int64_t d, float* acc) {
  constexpr int C = RB <= 3 ? 4 : 2;
  const int64_t wide = d / (C * W) * (C * W);
  accumulate_pv<RB, C>(p, alpha, vrow, count, d, 0, wide, acc);
  accumulate_pv<RB, 1>(p, alpha, vrow, count, d, wide, d, acc);
}

template <typename TV>
void accumulate_rows(const float (*p)[kChunk], const float* alpha, const TV* const* vrow,
                     int count, int64_t num_rows, int64_t d, float* acc) {
  int64_t r = 0;
  for (; r + 4 <= num_rows; r += 4)
    accumulate_decode<4>(p + r, alpha + r, vrow, count, d, acc + r * d);
  // the rest in one pass over V (a GQA group of 3 rows, SmolLM2's decode, reads V once, not 3x)
  float* rest = acc + r * d;
  switch (num_rows - r) {
    case 3: accumulate_decode<3>(p + r, alpha + r, vrow, count, d, rest); break;
    case 2: accumulate_decode<2>(p + r, alpha + r, vrow, count, d, rest); break;
    case 1: accumulate_decode<1>(p + r, alpha + r, vrow, count, d, rest); break;
    default: break;
  }
}

// Scores of R query rows (fp32, [R, d], pre-scaled) against the keys krow[0..16) into
// s[R][16]: each key vector is loaded (widened) once for all R rows of a GQA group (a row at a
// time loaded it R times: Zen 3, SmolLM2's 3-row groups at 96 keys, 7.4 -> 6.3 us a layer
// with accumulate_decode's change 5.2); four keys a pass, their sums one shuffle tree a row
// (simd::sum4). Keys past `count` read zeros; a pass wholly past it is skipped (-inf: the
// softmax masks those lanes).
template <int R, typename TKV>
inline void dots16_rows(const float* q, const TKV* const* krow, int count, int64_t d,
                        float (*s)[kChunk]) {
  for (int j = 0; j < kChunk; j += 4) {
    if (j >= count) {
      for (int r = 0; r < R; ++r) std::fill(s[r] + j, s[r] + j + 4, kNegInf);
      continue;
    }
    Vec a[R][4];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 4; ++k) a[r][k] = Vec::zero();
    for (int64_t c = 0; c < d; c += W) {
      for (int k = 0; k < 4; ++k) {  // a key in a register, the rows' q from L1
        const Vec kv = Vec::load(krow[j + k] + c);
        for (int r = 0; r < R; ++r) a[r][k] = simd::fma(Vec::load(q + r * d + c), kv, a[r][k]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s[r] + j, simd::sum4(a[r][0].v, a[r][1].v, a[r][2].v, a[r][3].v));
  }
}

// Rows [r, r + R) of a decode batch: scores (dots16_rows), then each row's softmax step.
template <int R, typename TKV>
inline void decode_rows(const Rows& w, int64_t r, const TKV* const* krow, int count, int64_t d,
                        float (*p)[kChunk], float* alpha) {
  alignas(64) float s[R][kChunk];
  dots16_rows<R>(w.q + r * d, krow, count, d, s);
  for (int i = 0; i < R; ++i) {
    Vec v[kChunkVecs];
    for (int k = 0; k < kChunkVecs; ++k) v[k] = Vec::load(s[i] + k * W);
    alpha[i] = softmax_into(v, count, w.m[r + i], w.l[r + i], p[i]);
  }
}

// Decode: one kv head's `group` rows against keys [pos, pos + count), read in place.
template <typename TKV>
void decode_chunk(const Rows& w, int64_t num_rows, const TKV* const* krow, const TKV* const* vrow,
                  int count, int64_t d) {
  alignas(64) float p[kChunk][kChunk];  // rows of a group: at most kChunk per batch
  float alpha[kChunk];
  for (int64_t r0 = 0; r0 < num_rows; r0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, num_rows - r0);
    int64_t r = 0;  // by threes (twelve accumulators), then the rest
    for (; r + 3 <= n; r += 3) decode_rows<3>(w, r0 + r, krow, count, d, p + r, alpha + r);
    if (n - r == 2) decode_rows<2>(w, r0 + r, krow, count, d, p + r, alpha + r);
    if (n - r == 1) decode_rows<1>(w, r0 + r, krow, count, d, p + r, alpha + r);
    accumulate_rows(p, alpha, vrow, count, n, d, w.acc + r0 * d);
  }
}

// Prefill rows [r0, r0 + RB) against one chunk at positions [pos, pos + count); row r sits
// at position first_pos + r / group and sees keys up to it.
template <int RB>
void prefill_rows(const Rows& w, int64_t r0, const float* kT, const float* const* vrow,
                  int count, int64_t pos, int64_t first_pos, int64_t group, int64_t d) {
  Vec s[RB][kChunkVecs];
  alignas(64) float p[RB][kChunk];
  float alpha[RB];
  dots16_transposed<RB>(w.q + r0 * d, kT, d, s);
  for (int r = 0; r < RB; ++r) {
    const int64_t row_pos = first_pos + (r0 + r) / group;
    const int visible = int(std::clamp<int64_t>(row_pos + 1 - pos, 0, count));
    if (visible == 0) {  // the chunk lies after this row's position: nothing to add
      std::fill(p[r], p[r] + kChunk, 0.f);
      alpha[r] = 1.f;
      continue;
    }
    alpha[r] = softmax_into(s[r], visible, w.m[r0 + r], w.l[r0 + r], p[r]);
  }
  accumulate_pv<RB, 1>(p, alpha, vrow, count, d, 0, d, w.acc + r0 * d);
}

// Widens keys [pos, pos + count) of one kv head into kT [d][16] (missing keys 0) and their
// values into vf [16][d].
template <typename TKV>
void widen_chunk(const TKV* const* krow, const TKV* const* vrow, int count, int64_t d, float* kT,
                 float* vf) {
  alignas(64) float row[kMaxHeadDim];
  if (count < kChunk) std::fill(kT, kT + d * kChunk, 0.f);
  for (int j = 0; j < count; ++j) {
    for (int64_t c = 0; c < d; c += W) {
      Vec::load(vrow[j] + c).store(vf + j * d + c);
      Vec::load(krow[j] + c).store(row + c);
    }
    for (int64_t c = 0; c < d; ++c) kT[c * kChunk + j] = row[c];
  }
}

// One work item: for each kv head in [kv_begin, kv_end), rows = (query position, head of its
// group), positions ascending.
// A split item (it.part >= 0) leaves its rows' running max, sum and unnormalized accumulator
// in parts (merge_parts) instead of writing out.
template <typename TQ, typename TKV>
void attend_item(const Item& it, const TQ* q, TQ* out, const Layout<TKV>& lay,
                 const int32_t* table, int64_t num_heads, int64_t first_pos, float scale,
                 float* parts) {
  if (attend_item_native(it, q, out, lay, table, num_heads, first_pos, scale, parts)) return;
  alignas(64) static const TKV zeros[kMaxHeadDim] = {};
  const int64_t d = lay.head_dim;
  const int64_t group = num_heads / lay.num_kv_heads;
  const int64_t num_pos = it.row_end - it.row_begin;
  const int64_t num_rows = num_pos * group;  // per kv head
  const int64_t num_kv = it.kv_end - it.kv_begin;
  const int64_t last_pos = first_pos + num_pos - 1;  // the furthest key any row may see
  const bool prefill = num_pos > 1;

  // per-thread scratch, kept between items
  const int64_t per_head = num_rows * (2 * d + 2);
  thread_local std::vector<float> buf;
  buf.resize(num_kv * per_head + 2 * kChunk * d);
  float* kT = buf.data() + num_kv * per_head;  // [d, kChunk] (prefill)
  float* vf = kT + kChunk * d;                 // [kChunk, d] (prefill)
  std::vector<Rows> heads(num_kv);
  for (int64_t h = 0; h < num_kv; ++h) {
    Rows& w = heads[h];
    w.q = buf.data() + h * per_head;
    w.acc = w.q + num_rows * d;
    w.m = w.acc + num_rows * d;
    w.l = w.m + num_rows;
    std::fill(w.acc, w.acc + num_rows * d, 0.f);
    std::fill(w.m, w.m + num_rows, kNegInf);
    std::fill(w.l, w.l + num_rows, 0.f);
    const Vec f = Vec::broadcast(scale);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t i = r / group, head = (it.kv_begin + h) * group + r % group;
      const TQ* src = q + ((it.row_begin + i) * num_heads + head) * d;
      for (int64_t c = 0; c < d; c += W) (Vec::load(src + c) * f).store(w.q + r * d + c);
    }
  }

  const TKV* krow[kChunk];
  const TKV* vrow[kChunk];
  const float* vf_rows[kChunk];
  for (int j = 0; j < kChunk; ++j) vf_rows[j] = vf + j * d;
  // the keys this item sees: all up to last_pos, or its split's
  const int64_t key_last = it.key_end < 0 ? last_pos : std::min(last_pos, it.key_end - 1);
  for (int64_t pos = it.key_begin; pos <= key_last; pos += kChunk) {
    const int count = int(std::min<int64_t>(kChunk, key_last + 1 - pos));
    for (int64_t h = 0; h < num_kv; ++h) {
      const int64_t kv_head = it.kv_begin + h;
      for (int j = 0; j < kChunk; ++j) {  // keys past `count` read as zeros: finite scores
        const int64_t o = j < count ? lay.offset(table, kv_head, pos + j) : -1;
        krow[j] = o < 0 ? zeros : lay.key_cache + o;
        vrow[j] = o < 0 ? zeros : lay.value_cache + o;
      }
      if (!prefill) {
        decode_chunk(heads[h], num_rows, krow, vrow, count, d);
        continue;
      }
      widen_chunk(krow, vrow, count, d, kT, vf);
      // rows whose position is before this chunk see none of it
      int64_t r = std::max<int64_t>(0, (pos - first_pos) * group);
      for (; r + 4 <= num_rows; r += 4)
        prefill_rows<4>(heads[h], r, kT, vf_rows, count, pos, first_pos, group, d);
      for (; r < num_rows; ++r)
        prefill_rows<1>(heads[h], r, kT, vf_rows, count, pos, first_pos, group, d);
    }
  }
  if (it.part >= 0) {  // a split: one kv head, one position (make_items)
    float* dst = parts + it.part * num_rows * (d + 2);
    std::copy(heads[0].acc, heads[0].acc + num_rows * d, dst);
    std::copy(heads[0].m, heads[0].m + num_rows, dst + num_rows * d);
    std::copy(heads[0].l, heads[0].l + num_rows, dst + num_rows * (d + 1));
    return;
  }
  for (int64_t h = 0; h < num_kv; ++h) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t i = r / group, head = (it.kv_begin + h) * group + r % group;
      const Vec inv = Vec::broadcast(1.f / heads[h].l[r]);
      TQ* dst = out + ((it.row_begin + i) * num_heads + head) * d;
      for (int64_t c = 0; c < d; c += W) (Vec::load(heads[h].acc + r * d + c) * inv).store(dst + c);
    }
  }
}

// From this many keys on, a lone decode's kv heads go to separate items (threads).
constexpr int64_t kSplitDecodeKeys = 128;
// ... and in a running team (AttentionPlan), whose members wait for no wake-up, from this many:
// SmolLM2's 3 kv heads as 3 items over 2 members from 32 keys instead of one item on one
// member until 128
constexpr int64_t kTeamHeadItemsFrom = 32;
// ... and where its kv heads alone are too few to share out evenly (SmolLM2's 3 over 2
// threads: one thread took two, the other one and then waited), each kv head's keys are split
// into parts of at least this many, merged after (flash-decoding's split-K).
constexpr int64_t kMinSplitKeys = 64;

// head_items_from (at most kSplitDecodeKeys): the keys from which a few decodes' kv heads are
// items of their own (kSplitDecodeKeys where threads must be woken for them; a running team's
// members are awake: AttentionPlan). Each kv head's rows are computed alike either way.
std::vector<Item> make_items(const int64_t* query_start_loc, const int64_t* seq_lens,
                             int64_t num_seqs, int64_t num_kv_heads, int64_t num_threads,
                             int64_t prefill_tile, int64_t head_items_from,
                             std::vector<Merge>& merges) {
  std::vector<Item> items;
  // A decode is one item for all its kv heads (their rows sit side by side in each slot: one
  // sweep reads them all), unless too few decodes keep the threads busy and its context is
  // long enough to be worth splitting: then one item per kv head, and where that is still
  // fewer than two items a thread, each kv head's keys in parts.
  int64_t num_decodes = 0, num_long = 0;
  for (int64_t b = 0; b < num_seqs; ++b)
    if (query_start_loc[b + 1] - query_start_loc[b] == 1) {
      ++num_decodes;
      num_long += seq_lens[b] >= kSplitDecodeKeys;
    }
  const bool few_decodes = num_threads > 1 && num_decodes < 2 * num_threads;
  // parts a split kv head: enough for two items a thread over the long decodes' kv heads
  const int64_t split_heads = std::max<int64_t>(num_kv_heads * num_long, 1);
  const int64_t want_parts = (2 * num_threads + split_heads - 1) / split_heads;
  int64_t num_parts = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t begin = query_start_loc[b], end = query_start_loc[b + 1];
    if (end - begin == 1) {
      const bool split = few_decodes && seq_lens[b] >= head_items_from;
      const int64_t per_item = split ? 1 : num_kv_heads;
      const int64_t splits = split && seq_lens[b] >= kSplitDecodeKeys
                                 ? std::clamp<int64_t>(want_parts, 1, seq_lens[b] / kMinSplitKeys)
                                 : 1;
      if (splits > 1) {
        // parts of whole chunks of keys, the last one the rest
        const int64_t step = (seq_lens[b] + splits - 1) / splits;
        const int64_t part_keys = (step + kChunk - 1) / kChunk * kChunk;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t first = num_parts;
          for (int64_t k0 = 0; k0 < seq_lens[b]; k0 += part_keys) {
            const int64_t k1 = std::min(seq_lens[b], k0 + part_keys);
            items.push_back({b, h, h + 1, begin, end, k1 - k0, k0, k1, num_parts++});
          }
          merges.push_back({begin, h, first, num_parts - first});
        }
        continue;
      }
      for (int64_t h = 0; h < num_kv_heads; h += per_item)
        items.push_back({b, h, std::min(h + per_item, num_kv_heads), begin, end,
                         seq_lens[b] * per_item});
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = begin; r < end; r += prefill_tile) {
        const int64_t r_end = std::min(end, r + prefill_tile);
        items.push_back({b, h, h + 1, r, r_end, (seq_lens[b] - (end - r_end)) * (r_end - r)});
      }
  }
  // longest first, handed out dynamically: the last items to start are the short ones
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// Each split decode's output from its parts: per row, the parts' sums and accumulators scaled
// to their common max (exp(m_s - M)), then divided by the summed sum.
template <typename TQ>
void merge_parts(const std::vector<Merge>& merges, const float* parts, TQ* out,
                 int64_t num_heads, int64_t group, int64_t d) {
  const int64_t part_floats = group * (d + 2);
  for (const Merge& mg : merges) {
    for (int64_t r = 0; r < group; ++r) {
      float m = kNegInf;
      for (int64_t s = 0; s < mg.num_parts; ++s)
        m = std::max(m, parts[(mg.first_part + s) * part_floats + group * d + r]);
      alignas(64) float acc[kMaxHeadDim] = {};
      float l = 0.f;
      for (int64_t s = 0; s < mg.num_parts; ++s) {
        const float* part = parts + (mg.first_part + s) * part_floats;
        const float f = std::exp(part[group * d + r] - m);  // every part saw keys: l > 0
        l += part[group * (d + 1) + r] * f;
        const Vec fv = Vec::broadcast(f);
        for (int64_t c = 0; c < d; c += W)
          simd::fma(fv, Vec::load(part + r * d + c), Vec::load(acc + c)).store(acc + c);
      }
      const Vec inv = Vec::broadcast(1.f / l);
      TQ* dst = out + (mg.row * num_heads + mg.kv_head * group + r) * d;
      for (int64_t c = 0; c < d; c += W) (Vec::load(acc + c) * inv).store(dst + c);
    }
  }
}

template <typename TQ, typename TKV>
Layout<TKV> layout_of(const at::Tensor& kv_cache) {
  const TKV* cache = kv_cache.data_ptr<TKV>();
  return {cache, cache + kv_cache.stride(0),
          int64_t(__builtin_ctzll(uint64_t(kv_cache.size(2)))), kv_cache.size(3),
          kv_cache.size(4)};
}

// f(TQ{}, TKV{}) for the queries' and the cache's dtypes (checked: check_inputs)
template <typename F>
void with_types(const at::Tensor& q, const at::Tensor& kv_cache, const F& f) {
  if (q.scalar_type() == at::kFloat) {
    QUIRE_DISPATCH(kv_cache.scalar_type(), "paged_attention", f(float{}, T{}));
    return;
  }
  QUIRE_DISPATCH(q.scalar_type(), "paged_attention", f(T{}, T{}));
}

template <typename TQ, typename TKV>
void plan_typed(AttentionPlan& plan, const at::Tensor& q, const at::Tensor& kv_cache,
                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t threads,
                int64_t head_items_from) {
  const int64_t d = kv_cache.size(4), group = q.size(1) / kv_cache.size(3);
  plan.merges.clear();
  plan.items = make_items(query_start_loc.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                          seq_lens.size(0), kv_cache.size(3), threads,
                          std::is_same_v<TQ, at::BFloat16> && std::is_same_v<TKV, at::BFloat16>
                              ? prefill_positions_per_item(d, kPrefillTile)
                              : kPrefillTile,
                          head_items_from, plan.merges);
  int64_t num_parts = 0;
  for (const Merge& mg : plan.merges) num_parts += mg.num_parts;
  plan.group = group;
  plan.parts.resize(num_parts * group * (d + 2));
}

template <typename TQ, typename TKV>
void attend_typed(AttentionPlan& plan, int64_t k, at::Tensor& out, const at::Tensor& q,
                  const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  const Item& it = plan.items[k];
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t query_len = qsl[it.seq + 1] - qsl[it.seq];
  const int64_t first_pos =
      seq_lens.data_ptr<int64_t>()[it.seq] - query_len + (it.row_begin - qsl[it.seq]);
  attend_item<TQ, TKV>(it, q.data_ptr<TQ>(), out.data_ptr<TQ>(), layout_of<TQ, TKV>(kv_cache),
                       block_tables.data_ptr<int32_t>() + it.seq * block_tables.size(1),
                       q.size(1), first_pos, float(scale), plan.parts.data());
}

template <typename TQ, typename TKV>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
         const at::Tensor& seq_lens, double scale) {
  AttentionPlan plan;
  plan_typed<TQ, TKV>(plan, q, kv_cache, query_start_loc, seq_lens, at::get_num_threads(),
                      kSplitDecodeKeys);
  const int64_t num_items = int64_t(plan.items.size());
  const auto attend = [&](int64_t k) {
    attend_typed<TQ, TKV>(plan, k, out, q, kv_cache, block_tables, query_start_loc, seq_lens,
                          scale);
  };
  if (num_items == 1) {  // one short decode: no team to wake for it
    attend(0);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t k = 0; k < num_items; ++k) attend(k);
  merge_attention(plan, out);
}

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                  const at::Tensor& seq_lens) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [tokens, heads, dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.dtype() == q.dtype(),
              "out must be contiguous and shaped and typed like q");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(kv_cache.dtype() == q.dtype() || q.scalar_type() == at::kFloat,
              "kv_cache must have q's dtype, or any of fp32 / bf16 / fp16 under fp32 q");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(2) % 16 == 0 && q.size(2) <= kMaxHeadDim,
              "head_dim must match and be a multiple of 16, at most 512");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "block_size must be a power of two");
  TORCH_CHECK(block_tables.dtype() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  TORCH_CHECK(query_start_loc.dtype() == at::kLong && seq_lens.dtype() == at::kLong &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "query_start_loc and seq_lens must be contiguous int64");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_tables.size(0) >= seq_lens.size(0),
              "one block table and seq_len per sequence, num_seqs + 1 query starts");
}

}  // namespace

void merge_attention(const AttentionPlan& plan, at::Tensor& out) {
  if (plan.merges.empty()) return;
  QUIRE_DISPATCH(out.scalar_type(), "merge_attention",
                 merge_parts(plan.merges, plan.parts.data(), out.data_ptr<T>(), out.size(1),
                             plan.group, out.size(2)));
}

void plan_attention(AttentionPlan& plan, const at::Tensor& out, const at::Tensor& q,
                    const at::Tensor& kv_cache, const at::Tensor& block_tables,
                    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    int64_t threads) {
  check_inputs(out, q, kv_cache, block_tables, query_start_loc, seq_lens);
  with_types(q, kv_cache, [&](auto tq, auto tkv) {
    plan_typed<decltype(tq), decltype(tkv)>(plan, q, kv_cache, query_start_loc, seq_lens,
                                            threads, kTeamHeadItemsFrom);
  });
}

void attend_items(AttentionPlan& plan, at::Tensor& out, const at::Tensor& q,
                  const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  const int64_t num_items = int64_t(plan.items.size());
  with_types(q, kv_cache, [&](auto tq, auto tkv) {
    for (int64_t k = plan.next.fetch_add(1, std::memory_order_relaxed); k < num_items;
         k = plan.next.fetch_add(1, std::memory_order_relaxed))
      attend_typed<decltype(tq), decltype(tkv)>(plan, k, out, q, kv_cache, block_tables,
                                                query_start_loc, seq_lens, scale);
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale) {
  check_inputs(out, q, kv_cache, block_tables, query_start_loc, seq_lens);
  with_types(q, kv_cache, [&](auto tq, auto tkv) {
    run<decltype(tq), decltype(tkv)>(out, q, kv_cache, block_tables, query_start_loc, seq_lens,
                                     scale);
  });
}

namespace {

// Store each token's new K and V at its slot, narrowed to the cache's dtype: the cache write
// of every layer.
template <typename TIN, typename TKV>
void write_kv_typed(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping) {
  const int64_t width = k.size(1) * k.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  TKV* key_cache = kv_cache.data_ptr<TKV>();
  TKV* value_cache = key_cache + kv_cache.stride(0);
  const TIN* kp = k.data_ptr<TIN>();
  const TIN* vp = v.data_ptr<TIN>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);  // token rows (see write_kv)
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TIN* kt = kp + t * k_stride;
      const TIN* vt = vp + t * v_stride;
      if constexpr (std::is_same_v<TIN, TKV>) {
        std::copy_n(kt, width, key_cache + slots[t] * width);
        std::copy_n(vt, width, value_cache + slots[t] * width);
      } else {
        for (int64_t c = 0; c < width; c += W) {
          simd::store_as_torch(Vec::load(kt + c), key_cache + slots[t] * width + c);
          simd::store_as_torch(Vec::load(vt + c), value_cache + slots[t] * width + c);
        }
      }
    }
  });
}

}  // namespace

void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && k.dim() == 3 &&
                  v.sizes() == k.sizes(),
              "write_kv: contiguous cache, k and v shaped [tokens, kv_heads, dim]");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4),
              "write_kv: k does not match the cache's kv heads and head_dim");
  TORCH_CHECK(k.dtype() == v.dtype() &&
                  (k.dtype() == kv_cache.dtype() || k.scalar_type() == at::kFloat),
              "write_kv: k and v in the cache's dtype, or fp32");
  TORCH_CHECK(k.dtype() == kv_cache.dtype() || (k.size(1) * k.size(2)) % W == 0,
              "write_kv: narrowing needs kv_heads * head_dim a multiple of ", W);
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.size(0) == k.size(0),
              "write_kv: one int64 slot per token");
  // a token's kv heads must lie side by side; its rows may be apart (k and v as views into
  // the QKV projection's output: copying them out first cost more than the write, one token)
  const auto rows_of = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor kc = rows_of(k), vc = rows_of(v), sc = slot_mapping.contiguous();
  if (k.scalar_type() == at::kFloat) {
    QUIRE_DISPATCH(kv_cache.scalar_type(), "write_kv",
                   write_kv_typed<float, T>(kv_cache, kc, vc, sc));
    return;
  }
  QUIRE_DISPATCH(k.scalar_type(), "write_kv", write_kv_typed<T, T>(kv_cache, kc, vc, sc));
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  // whether bf16 prefill attention runs on AMX tiles here; `want` turns that on or off
  m.def("attention_tiles(bool? want=None) -> bool", &attention_tiles);
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

}  // namespace QUIRE_NS
