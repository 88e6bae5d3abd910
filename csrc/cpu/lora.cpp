// Batched LoRA, punica-style: every token under its own adapter slot (0 or less: the base
// model, no delta), the slots' stacked weights read in place (engine_worker/lora/slots.py):
//
//   lora_shrink:  h[t] = A[slot[t]] @ x[t]          A [slots, R, K], x [T, K] -> h [T, R]
//   lora_expand:  y[t] += B[slot[t]] @ h[t]         B [slots, N, R], h [T, R], y [T, N]
//
// fp32, bf16 or fp16 (computed in fp32, h rounded to the inputs' dtype as the reference's
// matmul rounds it). One dot product per output value on the vector layer (vec.h); tokens are
// split across threads. Reference: shrink_reference / expand_reference in
// engine_worker/lora/ops.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;

// sum of a[i] * b[i] over n values (any n: a vector loop, then the tail one by one)
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  Vec acc0 = Vec::zero(), acc1 = Vec::zero();  // two chains: half the FMA latency
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = simd::fma(Vec::load(a + i), Vec::load(b + i), acc0);
    acc1 = simd::fma(Vec::load(a + i + W), Vec::load(b + i + W), acc1);
  }
  for (; i + W <= n; i += W) acc0 = simd::fma(Vec::load(a + i), Vec::load(b + i), acc0);
  float sum = simd::reduce_add(acc0 + acc1);
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

void check_slots(const at::Tensor& slots, int64_t tokens, int64_t num_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens,
              "lora: token_slots must be int64 [", tokens, "]");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] < num_slots, "lora: token ", t, " names slot ", s[t], " of ", num_slots);
}

}  // namespace

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && x.size(1) == a.size(2), "lora_shrink: shapes");
  TORCH_CHECK(x.scalar_type() == a.scalar_type(), "lora_shrink: x and A differ in dtype");
  const at::Tensor xc = x.contiguous(), ac = a.contiguous();
  const int64_t tokens = x.size(0), rank = a.size(1), k = a.size(2);
  check_slots(slots, tokens, a.size(0));
  at::Tensor h = at::zeros({tokens, rank}, x.options());
  const int64_t* s = slots.data_ptr<int64_t>();
  QUIRE_DISPATCH(x.scalar_type(), "lora_shrink", {
    const T* xp = xc.data_ptr<T>();
    const T* ap = ac.data_ptr<T>();
    T* hp = h.data_ptr<T>();
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (s[t] <= 0) continue;
        const T* weights = ap + s[t] * rank * k;
        for (int64_t r = 0; r < rank; ++r)
          hp[t * rank + r] = static_cast<T>(dot(weights + r * k, xp + t * k, k));
      }
    });
  });
  return h;
}

void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& b,
                 const at::Tensor& slots) {
  TORCH_CHECK(y.dim() == 2 && h.dim() == 2 && b.dim() == 3 && y.size(1) == b.size(1) &&
              h.size(1) == b.size(2) && y.size(0) == h.size(0), "lora_expand: shapes");
  TORCH_CHECK(y.stride(1) == 1, "lora_expand: y's rows must be contiguous");
  TORCH_CHECK(h.scalar_type() == b.scalar_type() && y.scalar_type() == b.scalar_type(),
              "lora_expand: y, h and B differ in dtype");
  const at::Tensor hc = h.contiguous(), bc = b.contiguous();
  const int64_t tokens = y.size(0), n = b.size(1), rank = b.size(2), y_stride = y.stride(0);
  check_slots(slots, tokens, b.size(0));
  const int64_t* s = slots.data_ptr<int64_t>();
  QUIRE_DISPATCH(y.scalar_type(), "lora_expand", {
    T* yp = y.data_ptr<T>();
    const T* hp = hc.data_ptr<T>();
    const T* bp = bc.data_ptr<T>();
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (s[t] <= 0) continue;
        const T* weights = bp + s[t] * n * rank;
        T* row = yp + t * y_stride;
        for (int64_t o = 0; o < n; ++o) {
          // rounded to T, then added in T: the reference's matmul and add_ round the same way
          const T delta = static_cast<T>(dot(weights + o * rank, hp + t * rank, rank));
          row[o] = static_cast<T>(static_cast<float>(row[o]) + static_cast<float>(delta));
        }
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor token_slots) -> Tensor");
  m.def("lora_expand(Tensor(a!) y, Tensor h, Tensor b, Tensor token_slots) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}

}  // namespace QUIRE_NS
