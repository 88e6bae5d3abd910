// The paged KV cache as the attention kernels read it, and their unit of work: shared by the
// varlen kernel (paged_attention.cpp) and an instruction set's own attention kernels
// (<isa>/attention.h).
#pragma once

#include <cstdint>

namespace QUIRE_NS {

constexpr int kChunk = 16;  // keys per chunk of the fp32 path: what <isa>/attention.h dots16 takes
constexpr int64_t kMaxHeadDim = 512;

// One work item: kv heads [kv_begin, kv_end) of one sequence, query rows [row_begin, row_end).
// A lone decode's kv head may be split over its keys (paged_attention.cpp, make_items): the
// item then sees keys [key_begin, key_end) only and leaves its softmax state in part `part`
// of the step's scratch, merged once every split is done.
struct Item {
  int64_t seq;
  int64_t kv_begin;
  int64_t kv_end;
  int64_t row_begin;  // first query row of the tile (global token index)
  int64_t row_end;
  int64_t cost;  // rows times the keys the last of them sees: its work, roughly
  int64_t key_begin = 0;
  int64_t key_end = -1;  // -1: every key the rows see
  int64_t part = -1;     // -1: the item writes its rows' output itself
};

// The splits of one (decode, kv head): parts [first_part, first_part + num_parts), merged
// into query row `row`'s heads of kv head `kv_head`.
struct Merge {
  int64_t row, kv_head, first_part, num_parts;
};

template <typename TKV>
struct Layout {
  const TKV* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const TKV* value_cache;
  int64_t block_shift;  // log2(block_size): block sizes are powers of two
  int64_t num_kv_heads;
  int64_t head_dim;

  // where logical position p of a sequence keeps kv head h's row, through its block table:
  // a shift and a mask, not a 64-bit division per key
  int64_t offset(const int32_t* table, int64_t h, int64_t p) const {
    const int64_t slot = (int64_t(table[p >> block_shift]) << block_shift) |
                         (p & ((int64_t(1) << block_shift) - 1));
    return (slot * num_kv_heads + h) * head_dim;
  }
};

}  // namespace QUIRE_NS
