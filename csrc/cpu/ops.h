// The CPU kernels other kernels call directly (no dispatcher, no Python between them).
#pragma once

#include <ATen/ATen.h>

#include <optional>

// The torch op namespace the build gives each instruction-set variant (quire_avx512, ...), so
// one process can load several: TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m).
#ifndef QUIRE_NS
#error "QUIRE_NS (the op namespace) is set by the build: see engine_worker/ops/cpu_build.py"
#endif

namespace quire {

// x [M <= 8, K] bf16 @ a weight from pack_skinny or pack_coded (+ bias) -> [M, N]
at::Tensor skinny_linear_packed(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias);
// weight * round(x / rms(x)) per row of x [rows, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// [rows, 2 * width] -> silu(gate) * up [rows, width]
at::Tensor silu_and_mul(const at::Tensor& x);
// NeoX rotary embedding in place on q, k [tokens, heads, head_dim]
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin);
// varlen paged attention over block tables into out [tokens, heads, head_dim]
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale);
// each token's k, v [tokens, kv_heads, head_dim] into its cache slot
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);

}  // namespace quire
