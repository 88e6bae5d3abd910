// The AVX2 kernels other kernels of this set call directly (no dispatcher between them).
// Declared in the namespace QUIRE_NS (quire_avx2 unless the build sets it), which is also the
// torch namespace the ops register in: torch.ops.quire_avx2.<name>.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "vec8.h"

// Runs the statement with T bound to the C++ type of an fp32 / bf16 / fp16 dtype.
#define QUIRE_AVX2_DISPATCH(dtype, name, ...)                                 \
  switch (dtype) {                                                            \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                 \
    case at::kBFloat16: { using T = at::BFloat16; __VA_ARGS__; break; }       \
    case at::kHalf: { using T = at::Half; __VA_ARGS__; break; }               \
    default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);         \
  }

namespace QUIRE_NS {

using Vec = simd::Vec8;  // the vector type the kernel bodies are written against

// weight * round(x / rms(x)) per row of x [rows, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// [rows, 2 * width] -> silu(gate) * up [rows, width]
at::Tensor silu_and_mul(const at::Tensor& x);
// NeoX rotary embedding in place on q, k [tokens, heads, head_dim]
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin);
// varlen paged attention over block tables into out [tokens, heads, head_dim]; the cache may
// be fp32, bf16 or fp16 under fp32 queries, else in the queries' dtype
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale);
// each token's k, v [tokens, kv_heads, head_dim] into its cache slot (narrowed to its dtype)
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);
// a bf16 weight [N, K] -> the layout linear_bf16w streams
at::Tensor pack_bf16w(const at::Tensor& w);
// x fp32 [M, K] @ a packed bf16 weight (+ fp32 bias [N]) -> fp32 [M, N]
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& packed_w,
                        const std::optional<at::Tensor>& bias);

}  // namespace QUIRE_NS
