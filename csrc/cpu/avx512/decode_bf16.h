// Decode attention on bf16 K/V with AVX-512 BF16 dot products, no widening of the cache.
//
// A decode is memory- and instruction-bound: every cached key and value is read once for a few
// query rows (the heads of one GQA group). Widening each K/V row to fp32 costs more
// instructions than the dot products themselves, so here the rows stay bf16:
//   scores: vdpbf16ps of the bf16 query with each key row (fp32 sums), four keys per shuffle
//           tree;
//   P @ V:  probabilities rounded to bf16 (as eager attention rounds them before P @ V) and
//           paired over consecutive keys; V rows of keys j and j+1 interleaved by 16-bit
//           unpacks, so one vdpbf16ps adds p_j v_j + p_j+1 v_j+1 for 16 dimensions. The unpacks
//           permute dimensions within 128-bit lanes; the permutation is undone on the way out.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace QUIRE_NS::decode_bf16 {

constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxZ = 8;        // head_dim / 32, head_dim up to 256

// A 32-dim slice's lo and hi accumulators times `inv`, stored as 32 bf16 in dimension order.
// The interleave permutes dimensions within 128-bit lanes: lane i of lo holds dimension
// 8 * (i / 4) + i % 4 of the slice, of hi that plus 4. One permute per 16 dimensions undoes
// it; one conversion rounds as at::BFloat16 does (to nearest even).
// A slice's lo and hi accumulators as its dimensions 0-15 (a) and 16-31 (b), in order.
inline void slice_in_order(__m512 lo, __m512 hi, __m512& a, __m512& b) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  a = _mm512_permutex2var_ps(lo, first, hi);
  b = _mm512_permutex2var_ps(lo, second, hi);
}

inline void store_slice(__m512 lo, __m512 hi, __m512 inv, at::BFloat16* out) {
  __m512 a, b;
  slice_in_order(lo, hi, a, b);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(b, inv),
                                                         _mm512_mul_ps(a, inv)));
}

// Where a chunk's 16 key (or value) rows are: an array of 16 pointers (rows past the chunk's
// count point at zeros), or, where its 16 keys lie one slot apart (attend checks each), its
// first row and the slot stride between rows (no pointer array to build: ~4 scalar
// instructions a row a head fewer). `none()`: no rows (no prefetch).
struct RowPtrs {
  const at::BFloat16* const* p;
  const at::BFloat16* operator[](int j) const { return p[j]; }
  bool none() const { return p == nullptr; }
};
struct RowRun {
  const at::BFloat16* base;
  int64_t stride;
  const at::BFloat16* operator[](int j) const { return base + j * stride; }
  bool none() const { return base == nullptr; }
};

// Scores [group][16] of the rows against the chunk's key rows (lanes past count are 0),
// prefetching the next chunk's key rows knext as it goes.
// GA, ZA: the arrays' sizes, exact where the caller knows the shape at compile time.
template <int GA, int ZA, typename R>
inline void scores(const __m512bh (&qv)[GA][ZA], R krow, int count, int group, int nz,
                   __m512 (&s)[GA], R knext) {
  for (int g = 0; g < group; ++g) s[g] = _mm512_setzero_ps();
  // four keys at a time, their rows loaded once for every query row; an insert's lane must
  // be a constant, so the four quads are spelled out
  auto quad = [&](auto lane) {
    constexpr int L = decltype(lane)::value, j = 4 * L;
    for (int t = 0; t < 4; ++t)
      for (int z = 0; z < nz; ++z)
        _mm_prefetch(reinterpret_cast<const char*>(knext[j + t] + 32 * z), _MM_HINT_T0);
    __m512bh k[4][ZA];
    for (int t = 0; t < 4; ++t)
      for (int z = 0; z < nz; ++z) k[t][z] = (__m512bh)_mm512_loadu_si512(krow[j + t] + 32 * z);
    for (int g = 0; g < group; ++g) {
      __m512 a[4];
      for (int t = 0; t < 4; ++t) {
        a[t] = _mm512_setzero_ps();
        for (int z = 0; z < nz; ++z) a[t] = _mm512_dpbf16_ps(a[t], qv[g][z], k[t][z]);
      }
      s[g] = _mm512_insertf32x4(s[g], simd::sum4(a[0], a[1], a[2], a[3]), L);
    }
  };
  quad(std::integral_constant<int, 0>{});
  if (count > 4) quad(std::integral_constant<int, 1>{});
  if (count > 8) quad(std::integral_constant<int, 2>{});
  if (count > 12) quad(std::integral_constant<int, 3>{});
}

// One kv head's `group` query rows of a decode: their bf16 queries, fp32 output accumulators
// and running softmax max / sum. G and NZ (head_dim / 32) are compile-time where the caller
// knows them (arrays sized exactly, in registers where they fit, not on the stack).
template <int G, int NZ>
struct Rows {
  static constexpr int GA = G > 0 ? G : kMaxGroup, ZA = NZ > 0 ? NZ : kMaxZ;
  __m512bh qv[GA][ZA];
  __m512 lo[GA][ZA], hi[GA][ZA];
  float m[GA], l[GA];
  int group, nz;
  // the shape's sizes, constants where the kernel was made for one (loops unrolled, the
  // accumulators in registers)
  int ng() const { return G > 0 ? G : group; }
  int nzs() const { return NZ > 0 ? NZ : nz; }

  // q: [group, d] bf16
  void start(const at::BFloat16* q, int group_rt, int nz_rt) {
    group = G > 0 ? G : group_rt;
    nz = NZ > 0 ? NZ : nz_rt;
    for (int g = 0; g < ng(); ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
      for (int z = 0; z < nzs(); ++z) {
        qv[g][z] = (__m512bh)_mm512_loadu_si512(q + g * 32 * nzs() + 32 * z);
        lo[g][z] = hi[g][z] = _mm512_setzero_ps();
      }
    }
  }

  // keys krow[0..count) and their values vrow (rows past count: zeros, as 16 pointers); the
  // next chunk's rows of the same head, knext / vnext, are prefetched on the way
  template <typename R>
  void add_chunk(R krow, R vrow, int count, float scale, R knext, R vnext) {
    __m512 s[GA];
    scores<GA, ZA>(qv, krow, count, ng(), nzs(), s, knext);
    add_scores(s, vrow, count, scale, vnext);
  }

  // the chunk's scores s[g] (unscaled; lanes past count ignored) into the softmax and P @ V
  template <typename R = RowPtrs>
  void add_scores(const __m512 (&s)[GA], R vrow, int count, float scale, R vnext = R{}) {
    // probabilities, as bf16 pairs (keys 2i, 2i + 1) per row
    alignas(64) uint32_t pairs[GA][8];
    // the accumulators as locals for the chunk (registers where the shape is a constant; as
    // members, each pair of keys loaded and stored all of them)
    __m512 acc_lo[GA][ZA], acc_hi[GA][ZA];
    for (int g = 0; g < ng(); ++g) {
      const Vec scaled[1] = {_mm512_mul_ps(s[g], _mm512_set1_ps(scale))};
      Vec p[1];
      const float alpha = simd::softmax_step(scaled, count, m[g], l[g], p);
      const __m256bh pb = _mm512_cvtneps_pbh(p[0].v);
      std::memcpy(pairs[g], &pb, 32);
      const __m512 a = _mm512_set1_ps(alpha);
      for (int z = 0; z < nzs(); ++z) {
        acc_lo[g][z] = _mm512_mul_ps(lo[g][z], a);
        acc_hi[g][z] = _mm512_mul_ps(hi[g][z], a);
      }
    }
    for (int j = 0; j < count; j += 2) {
      for (int z = 0; z < nzs(); ++z) {
        if (!vnext.none()) {
          _mm_prefetch(reinterpret_cast<const char*>(vnext[j] + 32 * z), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vnext[j + 1] + 32 * z), _MM_HINT_T0);
        }
        const __m512i v0 = _mm512_loadu_si512(vrow[j] + 32 * z);
        const __m512i v1 = _mm512_loadu_si512(vrow[j + 1] + 32 * z);
        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        for (int g = 0; g < ng(); ++g) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[g][j / 2]));
          acc_lo[g][z] = _mm512_dpbf16_ps(acc_lo[g][z], vlo, pp);
          acc_hi[g][z] = _mm512_dpbf16_ps(acc_hi[g][z], vhi, pp);
        }
      }
    }
    for (int g = 0; g < ng(); ++g)
      for (int z = 0; z < nzs(); ++z) {
        lo[g][z] = acc_lo[g][z];
        hi[g][z] = acc_hi[g][z];
      }
  }

  // A key split's state for merge_parts (paged_attention.cpp): the unnormalized accumulators
  // [group, d] fp32 in dimension order, then the rows' max, then their sums
  void finish_part(float* part) const {
    const int d = 32 * nzs();
    for (int g = 0; g < ng(); ++g) {
      for (int z = 0; z < nzs(); ++z) {
        __m512 a, b;
        slice_in_order(lo[g][z], hi[g][z], a, b);
        _mm512_storeu_ps(part + g * d + 32 * z, a);
        _mm512_storeu_ps(part + g * d + 32 * z + 16, b);
      }
      part[ng() * d + g] = m[g];
      part[ng() * (d + 1) + g] = l[g];
    }
  }

  // out: [group, d] bf16
  void finish(at::BFloat16* out) const {
    for (int g = 0; g < ng(); ++g) {
      const __m512 inv = _mm512_set1_ps(1.f / l[g]);
      for (int z = 0; z < nzs(); ++z)
        store_slice(lo[g][z], hi[g][z], inv, out + (g * nzs() + z) * 32);
    }
  }
};

// One decode: kv heads [0, num_kv) of a sequence side by side (head h's key row of slot p at
// keys + offsets[p] + h * d, its values likewise; its query rows q + h * group * d, its output
// out + h * group * d, [group, d] bf16 each) against `seq_len` keys.
//
// The heads walk the keys together, a chunk of 16 keys at a time: a slot holds every kv head's
// row side by side, and a sweep per head would read 2 * nz lines of each 2 * nz * num_kv, a
// stride the hardware prefetchers do not follow, leaving each core's few outstanding misses as
// the limit. Together they read whole slot rows, in order. On the 2-core Xeon with AMX (64
// decodes of 288 keys, SmolLM2's 3 kv heads of 64, 30 layers, blocks scattered, alternate
// runs): 59-73 ms a step before, 39-49 after (6-7 GB/s of K/V read against 9-11; a plain read
// of memory there runs at 21).
//
// The next chunk's lines of a head are asked for while this chunk's lines of that head are
// used, a few per group of keys (the AMX kernel asks a head at a time): the 192 lines of a
// chunk asked at its start are more than a core's outstanding misses, and then queue ahead of
// the chunk's own loads. On the 2-core Zen 4 (64 decodes of 192 keys, blocks scattered, 30
// layers, scripts/decode_attention_tiles.py, runs alternating with the code before this and
// vec.h's exp_scalar): 31.7-34.7 ms a step before, 26.0-29.8 after; the same reads alone
// take 12.6, and the kernel on keys in cache 9.
//
// A chunk whose 16 keys lie one slot apart, followed by a whole chunk, is read by stride
// (RowRun) instead of through pointer arrays; each quad's key rows are loaded once for all the
// group's query rows; a chunk's accumulators are locals (registers) instead of the members.
// On the 2-core Zen 4, runs alternating with the code before (scripts/decode_attention_tiles.py,
// 64 decodes of 320 keys, 30 layers): keys in cache 15.2-16.5 -> 9.6-9.7 ms a step, blocks
// scattered 40.3-43.6 -> 33.1-35.7; a lone decode of 1,000 keys in cache on one thread 51-52
// -> 33-39 us a layer. A lone decode inside the engine waits on memory instead (its attention
// a step unchanged within the noise at 1,000 keys).
//
// Keys [key_begin, key_end) only where `part` is given (a key split, flash-decoding's split-K:
// one kv head, its state left in part for merge_parts); else every key of seq_len.
template <int G, int NZ>
void attend(const at::BFloat16* q, at::BFloat16* out, int group_rt, int nz_rt, int num_kv,
            int64_t seq_len, float scale, const at::BFloat16* keys, const at::BFloat16* values,
            const int64_t* offsets, int64_t key_begin, int64_t key_end, float* part) {
  alignas(64) static const at::BFloat16 zeros[256] = {};
  const int64_t d = 32 * (NZ > 0 ? NZ : nz_rt);
  const int64_t rows_stride = (G > 0 ? G : group_rt) * d;
  thread_local std::vector<Rows<G, NZ>> heads;
  if (int(heads.size()) < num_kv) heads.resize(num_kv);
  for (int h = 0; h < num_kv; ++h) heads[h].start(q + h * rows_stride, group_rt, nz_rt);
  const int64_t end = part != nullptr ? key_end : seq_len;
  for (int64_t pos = part != nullptr ? key_begin : 0; pos < end; pos += 16) {
    const int count = int(std::min<int64_t>(16, end - pos));
    const int next = int(std::min<int64_t>(16, std::max<int64_t>(0, end - pos - 16)));
    // a chunk whose 16 keys lie one slot apart (one block of 16 or more, or blocks in order),
    // and a next one that starts a run too (read only by its prefetches): the rows by stride
    const int64_t stride = count == 16 && next == 16 ? offsets[pos + 1] - offsets[pos] : 0;
    bool runs = stride > 0 && offsets[pos + 31] - offsets[pos + 16] == 15 * stride;
    for (int j = 2; runs && j < 16; ++j) runs = offsets[pos + j] - offsets[pos] == j * stride;
    if (runs) {
      for (int h = 0; h < num_kv; ++h) {
        const int64_t here = offsets[pos] + h * d, there = offsets[pos + 16] + h * d;
        heads[h].add_chunk(RowRun{keys + here, stride}, RowRun{values + here, stride}, count,
                           scale, RowRun{keys + there, stride}, RowRun{values + there, stride});
      }
      continue;
    }
    for (int h = 0; h < num_kv; ++h) {
      const at::BFloat16* krow[16];
      const at::BFloat16* vrow[16];
      const at::BFloat16* knext[16];
      const at::BFloat16* vnext[16];
      for (int j = 0; j < 16; ++j) {
        krow[j] = j < count ? keys + offsets[pos + j] + h * d : zeros;
        vrow[j] = j < count ? values + offsets[pos + j] + h * d : zeros;
        knext[j] = j < next ? keys + offsets[pos + 16 + j] + h * d : zeros;
        vnext[j] = j < next ? values + offsets[pos + 16 + j] + h * d : zeros;
      }
      heads[h].add_chunk(RowPtrs{krow}, RowPtrs{vrow}, count, scale, RowPtrs{knext},
                         RowPtrs{vnext});
    }
  }
  if (part != nullptr) {
    heads[0].finish_part(part);
    return;
  }
  for (int h = 0; h < num_kv; ++h) heads[h].finish(out + h * rows_stride);
}

// A decode kernel's arguments, through the shape dispatch below.
struct DecodeArgs {
  const at::BFloat16* q;
  at::BFloat16* out;
  int group, nz, num_kv;
  int64_t seq_len;
  float scale;
  const at::BFloat16* keys;
  const at::BFloat16* values;
  const int64_t* offsets;
  int64_t key_begin = 0, key_end = 0;
  float* part = nullptr;  // a key split's state (attend)
};

template <typename Kernel, int G, int NZ>
inline bool run_if_shape(const DecodeArgs& a) {
  if constexpr (G > Kernel::kMaxGroup) {
    return false;
  } else {
    if (a.group != G || a.nz != NZ) return false;
    Kernel::template run<G, NZ>(a);
    return true;
  }
}

// Kernel::run<G, NZ> for the common shapes (arrays sized at compile time), <0, 0> (sized at
// run time) otherwise; shapes with more than Kernel::kMaxGroup query heads are never made.
template <typename Kernel>
inline void dispatch_shape(const DecodeArgs& a) {
  if (run_if_shape<Kernel, 1, 2>(a) || run_if_shape<Kernel, 2, 2>(a) ||
      run_if_shape<Kernel, 3, 2>(a) || run_if_shape<Kernel, 4, 2>(a) ||
      run_if_shape<Kernel, 1, 4>(a) || run_if_shape<Kernel, 2, 4>(a) ||
      run_if_shape<Kernel, 4, 4>(a) || run_if_shape<Kernel, 8, 4>(a))
    return;
  Kernel::template run<0, 0>(a);
}

struct Vectors {
  static constexpr int kMaxGroup = decode_bf16::kMaxGroup;
  template <int G, int NZ>
  static void run(const DecodeArgs& a) {
    attend<G, NZ>(a.q, a.out, a.group, a.nz, a.num_kv, a.seq_len, a.scale, a.keys, a.values,
                  a.offsets, a.key_begin, a.key_end, a.part);
  }
};

inline void dispatch(const at::BFloat16* q, at::BFloat16* out, int group, int64_t d, int num_kv,
                     int64_t seq_len, float scale, const at::BFloat16* keys,
                     const at::BFloat16* values, const int64_t* offsets,
                     int64_t key_begin = 0, int64_t key_end = 0, float* part = nullptr) {
  dispatch_shape<Vectors>({q, out, group, int(d / 32), num_kv, seq_len, scale, keys, values,
                           offsets, key_begin, key_end, part});
}

}  // namespace QUIRE_NS::decode_bf16
