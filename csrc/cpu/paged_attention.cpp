// Paged attention for CPUs with AVX-512: decode and chunked prefill in one varlen kernel.
//
// Every sequence b owns query rows [query_start_loc[b], query_start_loc[b + 1]) of the step and
// has seq_lens[b] tokens in the cache, its new ones included. Its query row i sits at position
// seq_lens[b] - query_len + i and sees keys 0..that position, read through block_tables[b].
// A decode is the case query_len == 1; a prefill chunk with cached context is the general case.
//
// Work items are (sequence, kv head, tile of query positions). Each item holds the query rows of
// every head in its GQA group, walks the keys in chunks of 16 slots, and keeps a running
// (online) softmax per row: max m, sum l, and an fp32 accumulator of P @ V. Keys and values of a
// chunk are widened to fp32 once and reused by all rows of the item.
//
// The pure-PyTorch reference is engine_worker/attention/torch_backend.py; tests compare the two.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "decode_bf16.h"
#include "ops.h"
#include "prefill_bf16.h"
#include "vec.h"

namespace quire {
namespace {

constexpr int kChunk = 16;          // keys per chunk: one zmm of scores per query row
constexpr int kPrefillTile = 32;    // query positions per work item in prefill

struct Item {
  int64_t seq;
  int64_t kv_begin;  // kv heads [kv_begin, kv_end)
  int64_t kv_end;
  int64_t row_begin;  // first query row of the tile (global token index)
  int64_t row_end;
  int64_t cost;  // rows times the keys the last of them sees: its work, roughly
};

// Per-item scratch: query rows, accumulators and softmax state, and the current key chunk.
struct Chunked {
  float* qf;
  float* acc;
  float* kf;
  float* vf;
  float* m;
  float* l;
};

template <typename T>
struct Layout {
  const T* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  const T* value_cache;
  int64_t block_size;  // a power of two
  int64_t block_shift;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t slot_stride() const { return num_kv_heads * head_dim; }
};

// Slot of logical position p of a sequence, through its block table.
template <typename T>
inline int64_t slot_offset(const Layout<T>& lay, const int32_t* table, int64_t kv_head,
                           int64_t p) {
  // block sizes are powers of two: shift and mask, not a 64-bit division per key
  const int64_t slot = (int64_t(table[p >> lay.block_shift]) << lay.block_shift) |
                       (p & (lay.block_size - 1));
  return slot * lay.slot_stride() + kv_head * lay.head_dim;
}

// Widen `count` keys and values at logical positions [pos, pos + count) to fp32 rows; keys
// either as rows ([16, d], decode) or transposed ([d, 16], prefill; missing keys are 0).
template <typename T>
void load_chunk(const Layout<T>& lay, const int32_t* table, int64_t kv_head, int64_t pos,
                int count, bool transpose_keys, float* kf, float* vf) {
  const int64_t d = lay.head_dim;
  alignas(64) float row[512];
  if (transpose_keys && count < kChunk) std::fill(kf, kf + d * kChunk, 0.f);
  for (int j = 0; j < count; ++j) {
    const int64_t offset = slot_offset(lay, table, kv_head, pos + j);
    vec::to_float(lay.value_cache + offset, vf + j * d, d);
    if (!transpose_keys) {
      vec::to_float(lay.key_cache + offset, kf + j * d, d);
      continue;
    }
    vec::to_float(lay.key_cache + offset, row, d);
    for (int64_t c = 0; c < d; ++c) kf[c * kChunk + j] = row[c];
  }
}

// Decode: the group's few rows see every cached key; one dot product per (row, key).
void decode_rows(const Chunked& w, int count, int64_t num_rows, int64_t d) {
  const __mmask16 live = __mmask16((1u << count) - 1u);
  for (int64_t r = 0; r < num_rows; ++r) {
    __m512 p[1];
    float alpha[1];
    p[0] = vec::softmax_weights(vec::dots16(w.qf + r * d, w.kf, count, d), live, w.m[r],
                                w.l[r], alpha[0]);
    vec::accumulate_pv<1>(p, alpha, w.vf, count, d, w.acc + r * d);
  }
}

// Prefill: rows four at a time against transposed keys, causal per row.
template <int RB>
void prefill_rows(const Chunked& w, int64_t r0, int count, int64_t pos, int64_t first_pos,
                  int64_t group, int64_t d) {
  __m512 s[RB], p[RB];
  float alpha[RB];
  vec::dots16_transposed<RB>(w.qf + r0 * d, w.kf, d, s);
  for (int r = 0; r < RB; ++r) {
    const int64_t row_pos = first_pos + (r0 + r) / group;
    const int64_t visible = std::clamp<int64_t>(row_pos + 1 - pos, 0, count);
    const __mmask16 live = __mmask16((1u << visible) - 1u);
    if (live) {
      p[r] = vec::softmax_weights(s[r], live, w.m[r0 + r], w.l[r0 + r], alpha[r]);
    } else {
      p[r] = _mm512_setzero_ps();
      alpha[r] = 1.f;
    }
  }
  vec::accumulate_pv<RB>(p, alpha, w.vf, count, d, w.acc + r0 * d);
}

// The bf16 fast paths (decode_bf16.h, prefill_bf16.h); false where they do not apply (another
// dtype, a head size they do not take, no AVX-512 BF16), leaving the item to the fp32 path.
template <typename T>
bool attend_item_bf16(const Item& it, const T* q, T* out, const Layout<T>& lay,
                      const int32_t* table, int64_t num_heads, int64_t first_pos, float scale) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const int64_t d = lay.head_dim, group = num_heads / lay.num_kv_heads;
    if (d % 32 != 0 || d > 256 || group > decode_bf16::kMaxGroup) return false;
    const int64_t num_pos = it.row_end - it.row_begin;
    const int64_t last_pos = first_pos + num_pos - 1;
    // each key's slot, once for all kv heads
    thread_local std::vector<int64_t> offsets;
    offsets.resize(last_pos + 1);
    for (int64_t p = 0; p <= last_pos; ++p) offsets[p] = slot_offset(lay, table, 0, p);
    for (int64_t kv_head = it.kv_begin; kv_head < it.kv_end; ++kv_head) {
      const T* keys = lay.key_cache + kv_head * d;
      const T* values = lay.value_cache + kv_head * d;
      const int64_t row = (it.row_begin * num_heads + kv_head * group) * d;
      if (num_pos == 1) {
        decode_bf16::dispatch(q + row, out + row, int(group), d, last_pos + 1, scale, keys,
                              values, offsets.data());
        continue;
      }
      // row (i, g): query position i of the tile, head g of the group
      auto at = [&](auto* base) {
        return [=](int64_t i, int64_t g) { return base + row + (i * num_heads + g) * d; };
      };
      prefill_bf16::attend_tile(at(q), at(out), num_pos, group, d, first_pos, scale, keys,
                                values, offsets.data());
    }
    return true;
  }
#endif
  return false;
}

// One work item: for each kv head in [kv_begin, kv_end), rows = (query position, head of its
// group), positions ascending. Decodes take every kv head of a sequence in one item where
// there are enough of them, so the heads' K/V rows, which sit side by side in each slot, are
// read in one sweep (see make_items).
template <typename T>
void attend_item(const Item& it, const T* q, T* out, const Layout<T>& lay, const int32_t* table,
                 int64_t num_heads, int64_t first_pos, float scale) {
  const int64_t d = lay.head_dim;
  const int64_t group = num_heads / lay.num_kv_heads;
  const int64_t num_pos = it.row_end - it.row_begin;
  const int64_t num_rows = num_pos * group;  // per kv head
  const int64_t num_kv = it.kv_end - it.kv_begin;
  const int64_t last_pos = first_pos + num_pos - 1;  // the furthest key any row may see
  const bool prefill = num_pos > 1;
  if (attend_item_bf16(it, q, out, lay, table, num_heads, first_pos, scale)) return;

  // per-thread scratch, kept between items; the key chunk starts zeroed so that rows past
  // `count` are finite (dots16 reads all 16)
  const int64_t per_head = num_rows * (2 * d + 2);
  thread_local std::vector<float> buf;
  buf.assign(num_kv * per_head + 2 * kChunk * d, 0.f);
  float* kf = buf.data() + num_kv * per_head;  // [kChunk, d] or [d, kChunk]
  float* vf = kf + kChunk * d;                 // [kChunk, d]
  std::vector<Chunked> heads(num_kv);
  for (int64_t h = 0; h < num_kv; ++h) {
    Chunked& w = heads[h];
    w.qf = buf.data() + h * per_head;  // [num_rows, d], pre-scaled
    w.acc = w.qf + num_rows * d;       // [num_rows, d]
    w.m = w.acc + num_rows * d;        // [num_rows] running max
    w.l = w.m + num_rows;              // [num_rows] running sum
    w.kf = kf;
    w.vf = vf;
    std::fill(w.m, w.m + num_rows, -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < num_pos; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = (it.kv_begin + h) * group + g;
        float* row = w.qf + (i * group + g) * d;
        vec::to_float(q + ((it.row_begin + i) * num_heads + head) * d, row, d);
        vec::scale(row, scale, d);
      }
    }
  }

  for (int64_t pos = 0; pos <= last_pos; pos += kChunk) {
    const int count = int(std::min<int64_t>(kChunk, last_pos + 1 - pos));
    // rows whose position is before this chunk see none of it
    const int64_t first_row = std::max<int64_t>(0, (pos - first_pos) * group);
    for (int64_t h = 0; h < num_kv; ++h) {
      const int64_t kv_head = it.kv_begin + h;
      load_chunk(lay, table, kv_head, pos, count, prefill, kf, vf);
      if (!prefill) {
        decode_rows(heads[h], count, num_rows, d);
        continue;
      }
      int64_t r = first_row;
      for (; r + 4 <= num_rows; r += 4)
        prefill_rows<4>(heads[h], r, count, pos, first_pos, group, d);
      for (; r < num_rows; ++r) prefill_rows<1>(heads[h], r, count, pos, first_pos, group, d);
    }
  }
  for (int64_t h = 0; h < num_kv; ++h) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t i = r / group, head = (it.kv_begin + h) * group + r % group;
      vec::store_scaled(heads[h].acc + r * d, 1.f / heads[h].l[r],
                        out + ((it.row_begin + i) * num_heads + head) * d, d);
    }
  }
}

// From this many keys on, one decode's kv heads split across threads pay for the split
// (measured here, one item against one per kv head: even at 32 keys, 10 % faster at 96 to
// 288, 20 % at 1000).
constexpr int64_t kSplitDecodeKeys = 128;

std::vector<Item> make_items(const int64_t* query_start_loc, const int64_t* seq_lens,
                             int64_t num_seqs, int64_t num_kv_heads, int64_t num_threads) {
  std::vector<Item> items;
  // A decode is one item for all its heads, unless there are too few decodes to keep every
  // thread busy (one request alone) and its context is long enough to be worth splitting
  // (kSplitDecodeKeys): then one item per kv head.
  int64_t num_decodes = 0;
  for (int64_t b = 0; b < num_seqs; ++b)
    num_decodes += query_start_loc[b + 1] - query_start_loc[b] == 1;
  const bool few_decodes = num_threads > 1 && num_decodes < 2 * num_threads;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t begin = query_start_loc[b], end = query_start_loc[b + 1];
    if (end - begin == 1) {
      const int64_t per_item =
          few_decodes && seq_lens[b] >= kSplitDecodeKeys ? 1 : num_kv_heads;
      for (int64_t h = 0; h < num_kv_heads; h += per_item)
        items.push_back({b, h, h + per_item, begin, end, seq_lens[b] * per_item});
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = begin; r < end; r += kPrefillTile) {
        const int64_t r_end = std::min(end, r + kPrefillTile);
        items.push_back({b, h, h + 1, r, r_end, (seq_lens[b] - (end - r_end)) * (r_end - r)});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
         const at::Tensor& seq_lens, double scale) {
  const int64_t num_heads = q.size(1);
  const int64_t block_size = kv_cache.size(2);
  Layout<T> lay{kv_cache[0].data_ptr<T>(), kv_cache[1].data_ptr<T>(), block_size,
                int64_t(__builtin_ctzll(uint64_t(block_size))), kv_cache.size(3),
                kv_cache.size(4)};
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.size(1);
  const std::vector<Item> items =
      make_items(qsl, lens, seq_lens.size(0), lay.num_kv_heads, at::get_num_threads());
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Items differ in size (a prefill tile late in a prompt sees more keys): hand them out
  // dynamically, longest first, on torch's threads.
  const int64_t num_items = int64_t(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t k = 0; k < num_items; ++k) {
    const Item& it = items[k];
    const int64_t query_len = qsl[it.seq + 1] - qsl[it.seq];
    const int64_t first_pos = lens[it.seq] - query_len + (it.row_begin - qsl[it.seq]);
    attend_item<T>(it, qp, op, lay, tables + it.seq * table_stride, num_heads, first_pos,
                   float(scale));
  }
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
  TORCH_CHECK(kv_cache.dtype() == q.dtype(), "kv_cache and q must share a dtype");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(2) % 16 == 0 && q.size(2) <= 512,
              "head_dim must match and be a multiple of 16, at most 512");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "block_size must be a power of two");
  TORCH_CHECK(block_tables.dtype() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  TORCH_CHECK(query_start_loc.dtype() == at::kLong && seq_lens.dtype() == at::kLong,
              "query_start_loc and seq_lens must be int64");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_tables.size(0) >= seq_lens.size(0),
              "one block table and seq_len per sequence, num_seqs + 1 query starts");
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale) {
  check_inputs(out, q, kv_cache, block_tables, query_start_loc, seq_lens);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale); break;
    case at::kBFloat16: run<at::BFloat16>(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale); break;
    case at::kHalf: run<at::Half>(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

namespace {

// Store each token's new K and V at its slot: the cache write of every layer.
template <typename T>
void write_kv_typed(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping) {
  const int64_t width = k.size(1) * k.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  T* key_cache = kv_cache[0].data_ptr<T>();
  T* value_cache = kv_cache[1].data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
      std::copy_n(kp + t * width, width, key_cache + slots[t] * width);
      std::copy_n(vp + t * width, width, value_cache + slots[t] * width);
    }
  });
}

}  // namespace

void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && k.dim() == 3 && v.sizes() == k.sizes(),
              "write_kv: contiguous cache, k and v shaped [tokens, kv_heads, dim]");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4),
              "write_kv: k does not match the cache's kv heads and head_dim");
  TORCH_CHECK(k.dtype() == kv_cache.dtype() && v.dtype() == kv_cache.dtype(),
              "write_kv: dtypes differ");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.size(0) == k.size(0),
              "write_kv: one int64 slot per token");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sc = slot_mapping.contiguous();
  switch (k.scalar_type()) {
    case at::kFloat: write_kv_typed<float>(kv_cache, kc, vc, sc); break;
    case at::kBFloat16: write_kv_typed<at::BFloat16>(kv_cache, kc, vc, sc); break;
    case at::kHalf: write_kv_typed<at::Half>(kv_cache, kc, vc, sc); break;
    default: TORCH_CHECK(false, "write_kv: unsupported dtype ", k.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

}  // namespace quire
