// The CPU kernels other kernels call directly (no dispatcher, no Python between them), for the
// instruction set this library is built for (vec.h). Declared in the namespace QUIRE_NS,
// which is also the torch namespace the ops register in: torch.ops.quire_avx512.<name>, ...
//
// Shared sources (this directory): RMSNorm, SwiGLU and RoPE (elementwise.cpp), varlen paged
// attention and the cache write (paged_attention.cpp), the fused layer halves and the layer
// stack (llama_block.cpp), GGUF block-quantized linear layers (quant_linear.cpp), batched
// LoRA (lora.cpp), the shared-memory all-reduce (shm_all_reduce.cpp), the sampler's row scans
// (sampling.cpp). Each instruction set adds, in its own directory, what only it can do: its
// linear layers (<isa>/linear.h) and its attention dot products and kernels
// (<isa>/attention.h).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "vec.h"

#if defined(QUIRE_ISA_AVX512)
#include "avx512/attention.h"
#include "avx512/linear.h"
#elif defined(QUIRE_ISA_AVX2)
#include "avx2/attention.h"
#include "avx2/linear.h"
#endif

// Runs the statement with T bound to the C++ type of an fp32 / bf16 / fp16 dtype.
#define QUIRE_DISPATCH(dtype, name, ...)                                      \
  switch (dtype) {                                                            \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                 \
    case at::kBFloat16: { using T = at::BFloat16; __VA_ARGS__; break; }       \
    case at::kHalf: { using T = at::Half; __VA_ARGS__; break; }               \
    default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);         \
  }

namespace QUIRE_NS {

// weight * round(x / rms(x)) per row of x [rows, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// h = h + x in place (rounded to h's dtype), then rms_norm(h, weight, eps), in one pass
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& x, const at::Tensor& weight,
                        double eps);
// out = a + b (rounded to their dtype); all contiguous, one shape
void add_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
// [rows, 2 * width] -> silu(gate) * up [rows, width]
at::Tensor silu_and_mul(const at::Tensor& x);
// rms_norm, add_rms_norm and silu_and_mul into the caller's out (contiguous, the result's
// shape, x's dtype)
void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_into(at::Tensor& out, at::Tensor& h, const at::Tensor& x,
                       const at::Tensor& weight, double eps);
void silu_and_mul_into(at::Tensor& out, const at::Tensor& x);
// NeoX rotary embedding in place on q, k [tokens, heads, head_dim]
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin);
// the same with q's rotation written to q_out (contiguous heads; q itself untouched unless it
// is q_out), k in place
void rotary_embedding_into(at::Tensor& q_out, const at::Tensor& q, at::Tensor& k,
                           const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin);
// varlen paged attention over block tables into out [tokens, heads, head_dim]; the cache may
// be fp32, bf16 or fp16 under fp32 queries, else in the queries' dtype
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale);
// One step's paged attention as work items (and the merges of lone decodes' key splits), the
// same for every layer of the step, for a team of threads (llama_block.cpp's team_layers):
// plan_attention makes it once a step and checks what paged_attention checks (q, out and this
// kv_cache; the step's other layers' caches must be alike); then, every layer, each member
// runs attend_items (items taken from `next`, reset to 0 before the members start), and once
// all are done one member runs merge_attention. Each row's result is paged_attention's, bit
// for bit.
struct AttentionPlan {
  std::vector<Item> items;
  std::vector<Merge> merges;
  std::vector<float> parts;
  int64_t group = 1;
  std::atomic<int64_t> next{0};
};
void plan_attention(AttentionPlan& plan, const at::Tensor& out, const at::Tensor& q,
                    const at::Tensor& kv_cache, const at::Tensor& block_tables,
                    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    int64_t threads);
void attend_items(AttentionPlan& plan, at::Tensor& out, const at::Tensor& q,
                  const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale);
void merge_attention(const AttentionPlan& plan, at::Tensor& out);
// each token's k, v [tokens, kv_heads, head_dim] into its cache slot (narrowed to its dtype)
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);
// Whether this CPU has AMX tiles (bf16 and int8) and the kernel lets this process use them
// (Linux asks each process to request the tile state; oneDNN, which runs its bf16 matmuls on
// them, asks the same way): checked once (quant_linear.cpp)
bool amx_tiles_usable();
// GGUF block-quantized weights (quant_linear.cpp): [N, K / 32, block bytes], the block bytes
// naming the type (Q4_0 18, Q4_1 20, Q8_0 34); uint8 as the file lays them out, int8 repacked
bool is_quantized_weight(const at::Tensor& w);
// the file's blocks (uint8) regrouped row by row for the decode kernel (int8, same shape)
at::Tensor repack_gguf(const at::Tensor& w);
// x fp32 / bf16 [M, K] @ dequant(w)^T (+ bias) -> [M, N] in x's dtype; `numerics`: the dtype
// the caller's model computes in, where its activations are wider (a bf16 model on the AVX2
// set, whose stack runs in fp32); x's own dtype where absent
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> numerics = std::nullopt);
// the most rows of bf16 x a call with this weight takes from its blocks where AMX tiles
// multiply Q4 blocks (the int8 kernel, then the tiles: quant_linear.cpp, avx512/quant_amx.h),
// 0 where none
int64_t quant_tile_rows(const at::Tensor& w);
// quant_linear(x, w, no bias) into out (contiguous [M, N] in x's dtype) where the weight is
// repacked and its int8 path takes x's rows: true; else false, out untouched (the caller runs
// quant_linear)
bool quant_linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                       std::optional<at::ScalarType> numerics = std::nullopt);
// A team of threads running together in one OpenMP parallel region (the layer stack's decode
// steps, llama_block.cpp), for the quantized linears between its barriers: each member's
// share of a linear's weight rows, which members done with their own take from its far end,
// and a spinning barrier (a parallel region's start and end cost each linear ~0.8 us on a
// Zen 4, and its threads waited for each other at the end ~0.5-1.8 us).
constexpr int kMaxTeam = 64;
struct QuantTeam {
  struct alignas(64) Share {
    std::atomic<uint64_t> units{0};  // [first << 32 | end): not yet taken
  };
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> phase{0};
  Share shares[kMaxTeam];
  // every one of the `size` members waits here until all have come
  void barrier(int size);
};
// whether quant_linear_into(out, x, w, numerics) takes an x of [rows, in_features] in dtype
// (what quant_linear_team needs)
bool quant_linear_into_takes(const at::Tensor& w, int64_t rows, int64_t in_features,
                             at::ScalarType dtype, std::optional<at::ScalarType> numerics);
// quant_linear_into's out, computed by a team: member `member` of `size`, every member calling
// with the same out, w and x's values (x may be each member's own copy); out is whole once
// every member has returned and they met at team.barrier
void quant_linear_team(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                       QuantTeam& team, int member, int size);
// the weight's values [N, K] in fp32 or bf16
at::Tensor dequantize_weight(const at::Tensor& w, at::ScalarType dtype);
// batched LoRA (lora.cpp): h [T, R] = A[slot[t]] @ x[t]; y[t] += h[t] @ B[slot[t]], B
// rank-major [slots, R, N]; `slices`: a fused projection's output sizes (slice i reads its
// own R / len(slices) ranks), empty for one
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& slots);
void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& b, const at::Tensor& slots,
                 c10::IntArrayRef slices);
// A step's tokens by adapter slot, made once and shared by every projection of every layer:
// group i is slot slots[i], its tokens order[starts[i], starts[i + 1]) in token order; base
// tokens (slot 0 or less) are in none.
struct LoRAGroups {
  int64_t num_tokens = 0;
  std::vector<int64_t> slots, starts, order;
};
LoRAGroups lora_groups(const at::Tensor& token_slots, int64_t num_slots);
// h [T, R] (zeros on base tokens, the caller's) = the shrink; A contiguous in x's dtype
void lora_shrink_into(at::Tensor& h, const at::Tensor& x, const at::Tensor& a,
                      const LoRAGroups& groups);
// y [T, N] += the expand of h [T, R] (contiguous); B contiguous in y's dtype
void lora_expand_into(at::Tensor& y, const at::Tensor& h, const at::Tensor& b,
                      const LoRAGroups& groups, c10::IntArrayRef slices);
// A tensor-parallel group's shared-memory segment (shm_all_reduce.cpp, laid out by
// engine_worker/distributed/shm.py): the ranks' flag lines, the two buffers of slots, and
// the sequence number this rank shares with Python's collectives
struct ShmGroup {
  int64_t* flags = nullptr;
  uint8_t* slots = nullptr;
  int64_t* seq = nullptr;
  int64_t rank = 0, world_size = 1, slot_bytes = 0;
};
// the group over `segment` (uint8) as `state` (int64 [seq, rank, world_size, slot_bytes])
// says, checked
ShmGroup shm_group(const at::Tensor& segment, const at::Tensor& state);
// x (contiguous fp32 / bf16 / fp16) = the sum of every rank's x, the same bits on each
void shm_all_reduce(at::Tensor& x, const ShmGroup& g);

}  // namespace QUIRE_NS
