// Batched LoRA, punica-style: every token under its own adapter slot (0 or less: the base
// model, no delta), the slots' stacked weights read in place (engine_worker/lora/slots.py):
//
//   lora_shrink:  h[t] = A[slot[t]] @ x[t]          A [slots, R, K], x [T, K] -> h [T, R]
//   lora_expand:  y[t] += h[t] @ B[slot[t]]         B [slots, R, N] (rank-major), y [T, N]
//
// B is rank-major (each rank row contiguous over the N outputs) so that the expand is a
// vectorised axpy over N per rank, no horizontal reduction per output value. A fused
// projection's B is block-diagonal (slice i's outputs read only its ranks, slots.py): given
// the slices' output sizes, the expand reads only those blocks; the zeros it skips add
// exactly nothing.
//
// The step's tokens are grouped by slot once (LoRAGroups, ops.h). A slot with at least
// kGemmRows tokens (a prefill chunk) runs as torch matmuls over its rows (gathered where they
// are not one run); the others run the vector kernels below in tiles of kTileTokens tokens,
// sharing each A row or B row among them while it is in registers.
//
// fp32, bf16 or fp16 (computed in fp32); roundings as the reference's (shrink_reference /
// expand_reference in engine_worker/lora/ops.py): h rounded to the inputs' dtype, the delta
// rounded to it, then added to y and rounded again.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;
constexpr int64_t kGemmRows = 16;   // a slot's tokens from here on: torch's matmul
constexpr int kTileTokens = 4;      // tokens sharing one load of a weight row
constexpr int kShrinkRows = 2;      // A rows a shrink tile holds (4 x 2 accumulators + loads)
constexpr int64_t kExpandCols = 2 * W;  // outputs an expand tile holds per token
constexpr int64_t kExpandSlab = 256;    // outputs per unit of parallel work

// ---------------------------------------------------------------------------------- shrink

// h[t][r] = dot(a row r, x row t) for NT tokens and NR rows, sharing every load across them
template <typename T, int NT, int NR>
inline void shrink_tile(const T* const* xs, const T* a, int64_t k, float (&out)[NT][NR]) {
  Vec acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = Vec::zero();
  int64_t i = 0;
  for (; i + W <= k; i += W) {
    Vec xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = Vec::load(xs[t] + i);
    for (int r = 0; r < NR; ++r) {
      const Vec av = Vec::load(a + r * k + i);
      for (int t = 0; t < NT; ++t) acc[t][r] = simd::fma(av, xv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) {
      float sum = simd::reduce_add(acc[t][r]);
      for (int64_t j = i; j < k; ++j)
        sum += static_cast<float>(a[r * k + j]) * static_cast<float>(xs[t][j]);
      out[t][r] = sum;
    }
}

template <typename T, int NT>
void shrink_tokens(const T* const* xs, T* const* hs, const T* a, int64_t rank, int64_t k) {
  int64_t r = 0;
  for (; r + kShrinkRows <= rank; r += kShrinkRows) {
    float out[NT][kShrinkRows];
    shrink_tile<T, NT, kShrinkRows>(xs, a + r * k, k, out);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < kShrinkRows; ++j) hs[t][r + j] = static_cast<T>(out[t][j]);
  }
  for (; r < rank; ++r) {
    float out[NT][1];
    shrink_tile<T, NT, 1>(xs, a + r * k, k, out);
    for (int t = 0; t < NT; ++t) hs[t][r] = static_cast<T>(out[t][0]);
  }
}

// ---------------------------------------------------------------------------------- expand

// y[t][c0, c1) += h[t][r0, r1) @ B[r0, r1)[c0, c1) for NT tokens: per rank row, one load of
// B's outputs and an fma per token; the delta rounded to T, added to y in fp32, rounded.
// h: the tokens' h rows widened to fp32, h_stride apart.
template <typename T, int NT>
void expand_tokens(T* const* ys, const float* h, int64_t h_stride, const T* b, int64_t n,
                   int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const auto add = [&](Vec delta, int t, int64_t c) {
    T* y = ys[t] + c;
    (Vec::load(y) + simd::round_as<T>(delta)).store(y);
  };
  int64_t c = c0;
  for (; c + kExpandCols <= c1; c += kExpandCols) {
    Vec acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = Vec::zero();
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = b + r * n + c;
      const Vec b0 = Vec::load(row), b1 = Vec::load(row + W);
      for (int t = 0; t < NT; ++t) {
        const Vec hv = Vec::broadcast(h[t * h_stride + r]);
        acc[t][0] = simd::fma(hv, b0, acc[t][0]);
        acc[t][1] = simd::fma(hv, b1, acc[t][1]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      add(acc[t][0], t, c);
      add(acc[t][1], t, c + W);
    }
  }
  for (; c + W <= c1; c += W) {
    Vec acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = Vec::zero();
    for (int64_t r = r0; r < r1; ++r) {
      const Vec bv = Vec::load(b + r * n + c);
      for (int t = 0; t < NT; ++t)
        acc[t] = simd::fma(Vec::broadcast(h[t * h_stride + r]), bv, acc[t]);
    }
    for (int t = 0; t < NT; ++t) add(acc[t], t, c);
  }
  for (; c < c1; ++c)
    for (int t = 0; t < NT; ++t) {
      float sum = 0.f;
      for (int64_t r = r0; r < r1; ++r)
        sum += h[t * h_stride + r] * static_cast<float>(b[r * n + c]);
      T* y = ys[t] + c;
      *y = static_cast<T>(static_cast<float>(*y) + static_cast<float>(static_cast<T>(sum)));
    }
}

// ---------------------------------------------------------------------- dispatch over tiles

// A tile's token count (1..kTileTokens) as the kernels' compile-time NT.
#define QUIRE_WITH_TILE(count, ...)                         \
  switch (count) {                                          \
    case 1: { constexpr int NT = 1; __VA_ARGS__; break; }   \
    case 2: { constexpr int NT = 2; __VA_ARGS__; break; }   \
    case 3: { constexpr int NT = 3; __VA_ARGS__; break; }   \
    default: { constexpr int NT = 4; __VA_ARGS__; break; }  \
  }
static_assert(kTileTokens == 4, "QUIRE_WITH_TILE unrolls 1..4 tokens");

// The vector kernels' work: (group, first token within it, tokens) tiles of the slots with
// fewer than kGemmRows tokens.
struct Tile {
  int64_t slot, first, count;
};

std::vector<Tile> small_tiles(const LoRAGroups& g) {
  std::vector<Tile> tiles;
  for (size_t i = 0; i < g.slots.size(); ++i) {
    const int64_t begin = g.starts[i], end = g.starts[i + 1];
    if (end - begin >= kGemmRows) continue;
    for (int64_t t = begin; t < end; t += kTileTokens)
      tiles.push_back({g.slots[i], t, std::min<int64_t>(kTileTokens, end - t)});
  }
  return tiles;
}

// The rows of one slot's tokens as a tensor: a view where they are one run, else gathered.
struct Rows {
  at::Tensor index;  // int64 token indices, undefined where the rows are [first, first + n)
  int64_t first = 0, count = 0;
  at::Tensor of(const at::Tensor& t) const {
    return index.defined() ? t.index_select(0, index) : t.narrow(0, first, count);
  }
};

Rows rows_of(const LoRAGroups& g, size_t i) {
  const int64_t begin = g.starts[i], end = g.starts[i + 1];
  const int64_t* tok = g.order.data() + begin;
  Rows rows{at::Tensor(), tok[0], end - begin};
  if (tok[end - begin - 1] - tok[0] != end - begin - 1)  // sorted and distinct: a run iff so
    rows.index = at::from_blob(const_cast<int64_t*>(tok), {end - begin}, at::kLong).clone();
  return rows;
}

void check_weights(const at::Tensor& w, const at::Tensor& act, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == act.scalar_type(), name,
              ": the LoRA stack must be contiguous [slots, ...] in the activations' dtype");
}

}  // namespace

LoRAGroups lora_groups(const at::Tensor& token_slots, int64_t num_slots) {
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.dim() == 1 &&
                  token_slots.is_contiguous(),
              "lora: token_slots must be int64 [tokens]");
  const int64_t tokens = token_slots.size(0);
  const int64_t* s = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> counts(std::max<int64_t>(num_slots, 1), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(s[t] < num_slots, "lora: token ", t, " names slot ", s[t], " of ", num_slots);
    if (s[t] > 0) ++counts[s[t]];
  }
  LoRAGroups g;
  g.num_tokens = tokens;
  std::vector<int64_t> next(counts.size(), 0);
  int64_t total = 0;
  for (int64_t slot = 1; slot < num_slots; ++slot)
    if (counts[slot] > 0) {
      g.slots.push_back(slot);
      g.starts.push_back(total);
      next[slot] = total;
      total += counts[slot];
    }
  g.starts.push_back(total);
  g.order.resize(total);
  for (int64_t t = 0; t < tokens; ++t)  // a stable counting sort: each group in token order
    if (s[t] > 0) g.order[next[s[t]]++] = t;
  return g;
}

void lora_shrink_into(at::Tensor& h, const at::Tensor& x, const at::Tensor& a,
                      const LoRAGroups& g) {
  // h [T, R] zero on base tokens (the caller's zeros); x [T, K] rows contiguous
  const int64_t rank = a.size(1), k = a.size(2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 && x.size(0) == g.num_tokens,
              "lora_shrink: x must be [tokens, ", k, "] with contiguous rows");
  check_weights(a, x, "lora_shrink");
  for (size_t i = 0; i < g.slots.size(); ++i) {
    if (g.starts[i + 1] - g.starts[i] < kGemmRows) continue;
    const Rows rows = rows_of(g, i);
    const at::Tensor hg = at::mm(rows.of(x), a.select(0, g.slots[i]).t());
    if (rows.index.defined()) h.index_copy_(0, rows.index, hg);
    else h.narrow(0, rows.first, rows.count).copy_(hg);
  }
  const std::vector<Tile> tiles = small_tiles(g);
  if (tiles.empty()) return;
  QUIRE_DISPATCH(x.scalar_type(), "lora_shrink", {
    const T* xp = x.data_ptr<T>();
    const T* ap = a.data_ptr<T>();
    T* hp = h.data_ptr<T>();
    const int64_t x_stride = x.stride(0);
    at::parallel_for(0, int64_t(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Tile& tile = tiles[i];
        const T* xs[kTileTokens];
        T* hs[kTileTokens];
        for (int64_t t = 0; t < tile.count; ++t) {
          const int64_t token = g.order[tile.first + t];
          xs[t] = xp + token * x_stride;
          hs[t] = hp + token * rank;
        }
        const T* weights = ap + tile.slot * rank * k;
        QUIRE_WITH_TILE(tile.count, shrink_tokens<T, NT>(xs, hs, weights, rank, k));
      }
    });
  });
}

void lora_expand_into(at::Tensor& y, const at::Tensor& h, const at::Tensor& b,
                      const LoRAGroups& g, c10::IntArrayRef slices) {
  const int64_t rank = b.size(1), n = b.size(2);
  TORCH_CHECK(y.dim() == 2 && y.size(1) == n && y.stride(1) == 1 && y.size(0) == g.num_tokens,
              "lora_expand: y must be [tokens, ", n, "] with contiguous rows");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == rank && h.size(0) == y.size(0) &&
                  h.scalar_type() == y.scalar_type(),
              "lora_expand: h must be contiguous [tokens, ", rank, "] in y's dtype");
  check_weights(b, y, "lora_expand");
  // (ranks, outputs) of each slice: slice i reads ranks [i R / S, (i + 1) R / S)
  const int64_t num_slices = slices.empty() ? 1 : int64_t(slices.size());
  TORCH_CHECK(rank % num_slices == 0, "lora_expand: ", num_slices, " slices do not divide rank ",
              rank);
  std::vector<int64_t> col_starts{0};
  for (int64_t s = 0; s < num_slices; ++s)
    col_starts.push_back(col_starts.back() + (slices.empty() ? n : slices[s]));
  TORCH_CHECK(col_starts.back() == n, "lora_expand: the slices' sizes must add up to ", n);
  const int64_t slice_rank = rank / num_slices;

  for (size_t i = 0; i < g.slots.size(); ++i) {
    if (g.starts[i + 1] - g.starts[i] < kGemmRows) continue;
    const Rows rows = rows_of(g, i);
    const at::Tensor hg = rows.of(h), bs = b.select(0, g.slots[i]);
    for (int64_t s = 0; s < num_slices; ++s) {
      const int64_t c0 = col_starts[s], cols = col_starts[s + 1] - c0;
      const at::Tensor delta = at::mm(hg.narrow(1, s * slice_rank, slice_rank),
                                      bs.narrow(0, s * slice_rank, slice_rank).narrow(1, c0, cols));
      at::Tensor out = y.narrow(1, c0, cols);
      if (rows.index.defined()) out.index_add_(0, rows.index, delta);
      else out.narrow(0, rows.first, rows.count).add_(delta);
    }
  }
  const std::vector<Tile> tiles = small_tiles(g);
  if (tiles.empty()) return;
  // units of parallel work: a tile of tokens times a slab of one slice's outputs
  struct Unit {
    int64_t tile, slice, c0, c1;
  };
  std::vector<Unit> units;
  for (int64_t t = 0; t < int64_t(tiles.size()); ++t)
    for (int64_t s = 0; s < num_slices; ++s)
      for (int64_t c = col_starts[s]; c < col_starts[s + 1]; c += kExpandSlab)
        units.push_back({t, s, c, std::min(c + kExpandSlab, col_starts[s + 1])});
  QUIRE_DISPATCH(y.scalar_type(), "lora_expand", {
    T* yp = y.data_ptr<T>();
    const T* hp = h.data_ptr<T>();
    const T* bp = b.data_ptr<T>();
    const int64_t y_stride = y.stride(0);
    at::parallel_for(0, int64_t(units.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(kTileTokens * rank);  // the tile's h rows in fp32
      for (int64_t u = begin; u < end; ++u) {
        const Unit& unit = units[u];
        const Tile& tile = tiles[unit.tile];
        const int64_t r0 = unit.slice * slice_rank, r1 = r0 + slice_rank;
        T* ys[kTileTokens];
        for (int64_t t = 0; t < tile.count; ++t) {
          const int64_t token = g.order[tile.first + t];
          ys[t] = yp + token * y_stride;
          for (int64_t r = r0; r < r1; ++r)
            widened[t * rank + r] = static_cast<float>(hp[token * rank + r]);
        }
        const T* weights = bp + tile.slot * rank * n;
        QUIRE_WITH_TILE(tile.count, expand_tokens<T, NT>(ys, widened.data(), rank, weights, n,
                                                         r0, r1, unit.c0, unit.c1));
      }
    });
  });
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && x.size(1) == a.size(2), "lora_shrink: shapes");
  TORCH_CHECK(x.scalar_type() == a.scalar_type(), "lora_shrink: x and A differ in dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0),
              "lora: token_slots must be int64 [", x.size(0), "]");
  const LoRAGroups g = lora_groups(slots.contiguous(), a.size(0));
  at::Tensor h = at::zeros({x.size(0), a.size(1)}, x.options());
  lora_shrink_into(h, x.stride(1) == 1 ? x : x.contiguous(), a.contiguous(), g);
  return h;
}

void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& b, const at::Tensor& slots,
                 c10::IntArrayRef slices) {
  TORCH_CHECK(y.dim() == 2 && h.dim() == 2 && b.dim() == 3 && y.size(1) == b.size(2) &&
                  h.size(1) == b.size(1) && y.size(0) == h.size(0),
              "lora_expand: shapes");
  TORCH_CHECK(y.stride(1) == 1, "lora_expand: y's rows must be contiguous");
  TORCH_CHECK(h.scalar_type() == b.scalar_type() && y.scalar_type() == b.scalar_type(),
              "lora_expand: y, h and B differ in dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == y.size(0),
              "lora: token_slots must be int64 [", y.size(0), "]");
  const LoRAGroups g = lora_groups(slots.contiguous(), b.size(0));
  lora_expand_into(y, h.contiguous(), b.contiguous(), g, slices);
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor token_slots) -> Tensor");
  m.def("lora_expand(Tensor(a!) y, Tensor h, Tensor b, Tensor token_slots, "
        "int[] slices=[]) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}

}  // namespace QUIRE_NS
