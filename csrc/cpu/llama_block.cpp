// The two halves of a Llama decoder layer around attention, and every layer in one call:
//
//   norm_qkv_rope:  x -> RMSNorm -> QKV projection -> RoPE on q and k       -> q, k, v
//   residual_mlp:   x, attn -> x + o_proj(attn) = h -> h + down(silu(gate) * up)(RMSNorm(h))
//   llama_layers:   per layer norm_qkv_rope, write_kv, paged_attention, residual_mlp
//
// With LoRA (llama_layers' lora_weights and lora_slots), each of the four linears' outputs
// gets its tokens' adapter deltas (lora.cpp) right after the linear, on the linear's input,
// as the per-layer path's LoRABatch.add puts them (engine_worker/models/llama.py).
//
// Each linear layer comes as two weights, one for few rows (decode, up to kFewRows) and one
// for more. Each may be
//   a weight in a layout this instruction set packs (<isa>/linear.h: AVX-512's pack_skinny /
//   pack_coded for few bf16 rows, AVX2's pack_bf16w panels under fp32 rows);
//   a oneDNN-packed weight (MkldnnCPU): oneDNN's matmul;
//   a plain fp32 weight [N, K]: torch's fp32 matmul;
//   a GGUF block-quantized weight (uint8 [N, K / 32, block bytes]): quant_linear.cpp, the same
//   weight for few rows and for more (llama_layers' `model_dtype` tells it a bf16 model's
//   rows, which the AVX2 set carries in fp32, so that they keep its int8 path past 8 rows).
// The activations are in the dtype the set's linear kernels take (kActivationType: bf16 on
// AVX-512, fp32 on AVX2). The ops run the same kernels the per-op path runs, in the same order
// with the same roundings, so their results are bit-identical to it; what goes is the Python
// and dispatcher time between ops, about 20 calls a layer (4-5 ms of a 15 ms single-request
// decode step, measured on AVX-512). Attention stays outside the halves: the backend writes
// the cache and attends between the two calls.
// References: engine_worker/layers/blocks.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int64_t kFewRows = 8;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x @ W^T + bias, W in whichever form the caller packed it (see the top of the file); a
// quantized W in a model computing in `numerics` (quant_linear's). Given `into` (a decode
// step's buffer: StepBuffers), a quantized W without a bias writes there and returns it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& few, const at::Tensor& many,
                  const std::optional<at::Tensor>& bias,
                  std::optional<at::ScalarType> numerics = std::nullopt,
                  at::Tensor* into = nullptr) {
  // a quantized weight's blocks also past the few rows where AMX tiles take them (quant_amx.h)
  const at::Tensor& w = x.size(0) <= kFewRows ||
                                (is_quantized_weight(few) && x.scalar_type() == at::kBFloat16 &&
                                 x.size(0) <= quant_tile_rows(few))
                            ? few
                            : many;
  if (into != nullptr && !bias.has_value() && is_quantized_weight(w) &&
      quant_linear_into(*into, x, w, numerics))
    return *into;
  if (w.is_mkldnn()) return onednn_linear(x, w, bias);
  if (is_quantized_weight(w)) return quant_linear(x, w, bias, numerics);
  if (std::optional<at::Tensor> out = packed_linear(x, w, bias)) return *std::move(out);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "a linear weight must be ",
              kPackedWeights, ", fp32 [N, K] or oneDNN-packed, for ", x.size(0), " rows");
  return at::linear(x, w, bias);
}

// One projection's LoRA in a step: its slots' stacked A and B (lora.cpp), the step's token
// groups and the fused projection's slices.
struct LoRAProjection {
  const at::Tensor* a;
  const at::Tensor* b;
  const LoRAGroups* groups;
  std::vector<int64_t> slices;
};

// y += the LoRA deltas of x's tokens (nothing without a projection)
void add_lora(at::Tensor& y, const at::Tensor& x, const LoRAProjection* lora) {
  if (lora == nullptr) return;
  at::Tensor h = at::zeros({x.size(0), lora->a->size(1)}, x.options());
  lora_shrink_into(h, x, *lora->a, *lora->groups);
  lora_expand_into(y, h, *lora->b, *lora->groups, lora->slices);
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == kActivationType &&
                  x.size(0) >= 1 && x.size(1) % kHiddenMultiple == 0,
              name, ": x must be contiguous ", kActivationType == at::kFloat ? "fp32" : "bf16",
              " [tokens >= 1, hidden], hidden % ", kHiddenMultiple, " == 0");
}

// A decode step's activations (rows up to kFewRows), made once for a stack and a row count
// (StepScratch, kept in LlamaStackWeights across calls) and written by every layer in turn,
// with the views of them that the layer takes: a layer otherwise makes and frees about twenty
// tensors, each at::empty, narrow or view some hundreds of ns of allocation and bookkeeping.
// Measured on a Zen 4 (2 threads, the embedded Q4_1 model, one
// request, a per-op timer in this file): the norms, RoPE and SwiGLU of a layer 7.3 -> 2.8 us,
// of about 70 us a layer. `out` (down's output, then the residual sum) is the next layer's x:
// each layer reads its x for the last time in add_rms_norm, before down writes there.
struct StepBuffers {
  at::Tensor normed, qkv, q_rows, k, v, q, attn, attn_rows, h, gate_up, act, out;
};

std::optional<StepBuffers> step_buffers(const at::Tensor& x, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim,
                                        int64_t gate_up_width) {
  if (gate_up_width <= 0 || gate_up_width % 2 != 0) return std::nullopt;
  const int64_t rows = x.size(0);
  const auto make = [&](int64_t width) { return at::empty({rows, width}, x.options()); };
  StepBuffers b;
  b.normed = make(x.size(1));
  b.qkv = make((num_heads + 2 * num_kv_heads) * head_dim);
  const auto heads = [&](int64_t first, int64_t count) {
    return b.qkv.narrow(1, first * head_dim, count * head_dim).view({rows, count, head_dim});
  };
  b.q_rows = heads(0, num_heads);
  b.k = heads(num_heads, num_kv_heads);
  b.v = heads(num_heads + num_kv_heads, num_kv_heads);
  b.q = at::empty({rows, num_heads, head_dim}, x.options());
  b.attn = at::empty({rows, num_heads, head_dim}, x.options());
  b.attn_rows = b.attn.view({rows, num_heads * head_dim});
  b.h = make(x.size(1));
  b.gate_up = make(gate_up_width);
  b.act = make(gate_up_width / 2);
  b.out = make(x.size(1));
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_qkv_rope_lora(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_few,
    const at::Tensor& qkv_many, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, const LoRAProjection* lora,
    std::optional<at::ScalarType> numerics = std::nullopt, StepBuffers* bufs = nullptr) {
  check_x(x, "norm_qkv_rope");
  const int64_t head_dim = cos.size(1), tokens = x.size(0);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "norm_qkv_rope: num_heads must be a positive multiple of num_kv_heads");
  at::Tensor normed;
  if (bufs != nullptr) {
    rms_norm_into(bufs->normed, x, norm_weight, eps);
    normed = bufs->normed;
  } else {
    normed = rms_norm(x, norm_weight, eps);
  }
  at::Tensor qkv = linear(normed, qkv_few, qkv_many, qkv_bias, numerics,
                          bufs != nullptr ? &bufs->qkv : nullptr);
  add_lora(qkv, normed, lora);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "norm_qkv_rope: the QKV weight does not give (heads + 2 kv heads) * head_dim");
  if (bufs != nullptr && qkv.is_same(bufs->qkv)) {
    rotary_embedding_into(bufs->q, bufs->q_rows, bufs->k, positions, cos, sin);
    return {bufs->q, bufs->k, bufs->v};
  }
  // views into the one [tokens, (heads + 2 kv_heads) * head_dim] output, as torch's split;
  // q's rotation goes to a tensor of its own, the contiguous q attention takes (one pass,
  // where rotating in place and copying took two)
  const at::Tensor q_rows = qkv.narrow(1, 0, num_heads * head_dim)
                                .view({tokens, num_heads, head_dim});
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  at::Tensor k = qkv.narrow(1, num_heads * head_dim, num_kv_heads * head_dim)
                     .view({tokens, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim)
                     .view({tokens, num_kv_heads, head_dim});
  rotary_embedding_into(q, q_rows, k, positions, cos, sin);
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_qkv_rope(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_few,
    const at::Tensor& qkv_many, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads) {
  return norm_qkv_rope_lora(x, norm_weight, eps, qkv_few, qkv_many, qkv_bias, positions, cos,
                            sin, num_heads, num_kv_heads, nullptr);
}

// The MLP's widest buffer (gate/up's output, then the SwiGLU product) a step streams through
// memory: past this many bytes the rows run in slices of at most this much, each slice's MLP
// whole before the next, so the buffer a slice writes is still in cache when the next op reads
// it. An 8,192-token pooling step of SmolLM2 (gate/up 2 x 1,536 wide, bf16) writes 48 MiB there
// and took 1.2-1.6x the time of four 2,048-token slices (oneDNN on AMX; slices of 1,024 rows
// were slower again). A prefill step of the default 2,048 tokens stays one slice. A sliced
// row may differ from the unsliced composition in its last bf16 bit (oneDNN blocks by the row
// count), so past one slice the op is the per-op path within bf16's tolerance, not bit for bit.
constexpr int64_t kMlpSliceBytes = int64_t(12) << 20;

// the output features of a weight for more rows, where its layout says (0 where not)
int64_t out_features(const at::Tensor& w) {
  if (w.is_mkldnn() || is_quantized_weight(w) || (w.scalar_type() == at::kFloat && w.dim() == 2))
    return w.size(0);
  return packed_out_features(w);
}

// rows a slice of `rows` takes: all of them where gate/up's output fits in kMlpSliceBytes (or
// its width is not known), else even slices that fit
int64_t mlp_slice_rows(int64_t rows, const at::Tensor& gate_up, int64_t element_size) {
  const int64_t width = out_features(gate_up);
  if (width <= 0) return rows;
  const int64_t fit = std::max<int64_t>(kMlpSliceBytes / (width * element_size), 1);
  if (rows <= fit) return rows;
  const int64_t slices = (rows + fit - 1) / fit;
  return (rows + slices - 1) / slices;
}

// A layer's second half's weights (see residual_mlp_lora)
struct MlpWeights {
  const at::Tensor& o_few;
  const at::Tensor& o_many;
  const std::optional<at::Tensor>& o_bias;
  const at::Tensor& norm_weight;
  double eps;
  const at::Tensor& gate_up_few;
  const at::Tensor& gate_up_many;
  const std::optional<at::Tensor>& gate_up_bias;
  const at::Tensor& down_few;
  const at::Tensor& down_many;
  const std::optional<at::Tensor>& down_bias;
  std::optional<at::ScalarType> numerics;  // the model's, for its quantized weights
};

// x + o_proj(attn) + mlp(norm(...)); into `dst` (rows of a larger output) when given, so a
// slice's result is written once instead of returned and copied; on `bufs` where given (a
// decode step's, without LoRA or tensor parallelism)
at::Tensor residual_mlp_rows(const at::Tensor& x, const at::Tensor& attn_rows,
                             const MlpWeights& w, const LoRAProjection* lora, const ShmGroup* tp,
                             at::Tensor* dst = nullptr, StepBuffers* bufs = nullptr) {
  at::Tensor h = linear(attn_rows, w.o_few, w.o_many, w.o_bias, w.numerics,
                        bufs != nullptr ? &bufs->h : nullptr);
  TORCH_CHECK(h.sizes() == x.sizes(), "residual_mlp: o_proj must map back to hidden");
  add_lora(h, attn_rows, lora ? lora + 0 : nullptr);
  if (tp) shm_all_reduce(h, *tp);  // row-parallel: every rank's partial sum
  at::Tensor normed, act;
  if (bufs != nullptr) {
    add_rms_norm_into(bufs->normed, h, x, w.norm_weight, w.eps);
    normed = bufs->normed;
  } else {
    normed = add_rms_norm(h, x, w.norm_weight, w.eps);  // h = x + o_proj(attn)
  }
  at::Tensor gate_up = linear(normed, w.gate_up_few, w.gate_up_many, w.gate_up_bias, w.numerics,
                              bufs != nullptr ? &bufs->gate_up : nullptr);
  add_lora(gate_up, normed, lora ? lora + 1 : nullptr);
  if (bufs != nullptr) {
    silu_and_mul_into(bufs->act, gate_up);
    act = bufs->act;
  } else {
    act = silu_and_mul(gate_up);
  }
  // (x is not read past this point: with bufs, down writes where x may be)
  at::Tensor out = linear(act, w.down_few, w.down_many, w.down_bias, w.numerics,
                          bufs != nullptr ? &bufs->out : nullptr);
  TORCH_CHECK(out.sizes() == x.sizes(), "residual_mlp: down_proj must map back to hidden");
  add_lora(out, act, lora ? lora + 2 : nullptr);
  if (tp) shm_all_reduce(out, *tp);
  at::Tensor& sum = dst == nullptr ? out : *dst;
  add_into(sum, out, h);
  return sum;
}

// lora: null, or the o, gate/up and down projections' LoRA, in that order. Rows past
// kMlpSliceBytes run in slices (not with LoRA: its token groups span the whole step); every
// rank of a tensor-parallel group slices the same rows alike, so their all-reduces pair up.
at::Tensor residual_mlp_lora(const at::Tensor& x, const at::Tensor& attn,
                             const at::Tensor& o_few, const at::Tensor& o_many,
                             const std::optional<at::Tensor>& o_bias,
                             const at::Tensor& norm_weight, double eps,
                             const at::Tensor& gate_up_few, const at::Tensor& gate_up_many,
                             const std::optional<at::Tensor>& gate_up_bias,
                             const at::Tensor& down_few, const at::Tensor& down_many,
                             const std::optional<at::Tensor>& down_bias,
                             const LoRAProjection* lora, const ShmGroup* tp = nullptr,
                             std::optional<at::ScalarType> numerics = std::nullopt,
                             StepBuffers* bufs = nullptr) {
  check_x(x, "residual_mlp");
  TORCH_CHECK(attn.dim() == 2 && attn.size(0) == x.size(0) && attn.dtype() == x.dtype(),
              "residual_mlp: attn must be [tokens, heads * head_dim] in x's dtype");
  const MlpWeights w{o_few, o_many, o_bias, norm_weight, eps, gate_up_few, gate_up_many,
                     gate_up_bias, down_few, down_many, down_bias, numerics};
  const at::Tensor attn_rows = attn.contiguous();
  const int64_t rows = x.size(0);
  const int64_t slice = lora != nullptr ? rows
                                        : mlp_slice_rows(rows, gate_up_many, x.element_size());
  if (slice >= rows) return residual_mlp_rows(x, attn_rows, w, lora, tp, nullptr, bufs);
  at::Tensor out = at::empty_like(x);
  for (int64_t r = 0; r < rows; r += slice) {
    const int64_t n = std::min(slice, rows - r);
    at::Tensor rows_out = out.narrow(0, r, n);  // contiguous: whole rows
    residual_mlp_rows(x.narrow(0, r, n), attn_rows.narrow(0, r, n), w, nullptr, tp, &rows_out);
  }
  return out;
}

at::Tensor residual_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_few,
                        const at::Tensor& o_many, const std::optional<at::Tensor>& o_bias,
                        const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_few,
                        const at::Tensor& gate_up_many,
                        const std::optional<at::Tensor>& gate_up_bias,
                        const at::Tensor& down_few, const at::Tensor& down_many,
                        const std::optional<at::Tensor>& down_bias) {
  return residual_mlp_lora(x, attn, o_few, o_many, o_bias, norm_weight, eps, gate_up_few,
                           gate_up_many, gate_up_bias, down_few, down_many, down_bias, nullptr);
}

// The next layer's K/V of a few short requests, asked for before this layer's MLP streams its
// weights past them: by the time that attention runs they are in cache instead of being
// fetched one dependent miss at a time (single request, ~350 keys, AVX-512: attention 1.24 ->
// 0.98 ms a step, MLP time unchanged). Skipped where they would not fit in L2 anyway
// (kPrefetchKvMaxBytes, <isa>/attention.h). A team's members each ask for every parts-th
// block (`part`: the member's own): each member's share of the asking, 46-60 us a step when
// both asked for every block, went to 20-24 (Zen 4, a phase timer in team_layers, not kept;
// attention's time unchanged within the noise).

void prefetch_kv(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, int part = 0, int parts = 1) {
  // kv_cache: [2, blocks, block_size, kv_heads, head_dim]
  const int64_t num_seqs = seq_lens.size(0), block_size = kv_cache.size(2);
  const int64_t slot_bytes = kv_cache.size(3) * kv_cache.size(4) * kv_cache.element_size();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) total += lens[b];
  if (2 * total * slot_bytes > kPrefetchKvMaxBytes) return;
  const char* keys = static_cast<const char*>(kv_cache.data_ptr());
  const int64_t values = kv_cache.stride(0) * kv_cache.element_size();  // V after all K
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t nth = 0;  // the blocks, dealt out to the parts in turn
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t pos = 0; pos < lens[b]; pos += block_size) {
      if (nth++ % parts != part) continue;
      const int64_t block = tables[b * block_tables.size(1) + pos / block_size];
      const int64_t bytes = std::min(block_size, lens[b] - pos) * slot_bytes;
      const char* k = keys + block * block_size * slot_bytes;
      for (int64_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(k + o, _MM_HINT_T0);
        _mm_prefetch(k + values + o, _MM_HINT_T0);
      }
    }
}

// Every decoder layer in one call: per layer norm_qkv_rope, the cache write, paged attention
// and residual_mlp, exactly as the per-layer path runs them, with no Python between layers.
// `stack` (LlamaStackWeights) holds kWeightsPerLayer weights a layer, in this order: input
// norm, QKV (few, many), o_proj (few, many), post-attention norm, gate/up (few, many), down
// (few, many); and four biases a layer: QKV, o_proj, gate/up, down. Given `attention_ns`
// (int64 [1]), the time spent in the cache writes and attention is added to it, for the step
// profiler. With LoRA, `lora_weights` holds eight tensors a layer: A then B (lora.cpp's
// layouts) of QKV, o_proj, gate/up and down, in the activations' dtype, and `lora_slots` each
// token's slot (int64 [tokens], 0: the base model); QKV's ranks split in three slices (q, k,
// v), gate/up's in two.
// Under tensor parallelism (`tp_segment` and `tp_state`: shm_all_reduce.cpp's group) the
// weights are this rank's shard and o_proj's and down's partial outputs are summed over the
// group's ranks in shared memory, where the per-layer path calls its all-reduce.
constexpr int64_t kWeightsPerLayer = 10, kBiasesPerLayer = 4, kLoRAPerLayer = 8;

// the nanoseconds since `start` added to `timer` where given (the step profiler's attention)
inline void add_elapsed(int64_t* timer, std::chrono::steady_clock::time_point start) {
  if (timer)
    *timer += std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::steady_clock::now() - start).count();
}

// A layer's cache write and attention (q rotated, k and v as QKV gave them), their time added
// to `timer` where given, then the next layer's K/V asked for (prefetch_kv)
void attend_layer(at::Tensor& attn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  at::TensorList kv_caches, int64_t i, const at::Tensor& slot_mapping,
                  const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                  const at::Tensor& seq_lens, double scale, int64_t* timer) {
  const auto start = std::chrono::steady_clock::now();
  at::Tensor kv_cache = kv_caches[i];
  write_kv(kv_cache, k, v, slot_mapping);
  paged_attention(attn, q, kv_cache, block_tables, query_start_loc, seq_lens, scale);
  add_elapsed(timer, start);
  if (i + 1 < int64_t(kv_caches.size())) prefetch_kv(kv_caches[i + 1], block_tables, seq_lens);
}

// llama_layers calls that ran team_layers, in this process (layer_team_calls: the tests')
std::atomic<int64_t> team_calls{0};

int64_t layer_team_calls() { return team_calls.load(std::memory_order_relaxed); }

// A decode step's layers with every linear on the int8 GGUF path, run by one team of threads
// (QuantTeam) from each layer's o_proj through the next layer's QKV: one OpenMP parallel region a
// layer instead of one a linear, the members meeting at a spinning barrier after each linear
// and taking each other's remaining weight rows when done with theirs. The small ops between
// the linears run on every member at once on its own copy (x, the residual sum h, the norm's and
// SwiGLU's outputs: some hundreds of values a row), so that no barrier waits for them; only the
// linears' outputs are shared. The whole step is one region: each layer's RoPE and cache
// write on one member, then its attention's work items (AttentionPlan, made once a step)
// taken by every member, where the per-layer path runs a lone short decode's attention on one
// thread while the others wait (SmolLM2's 3 kv heads are 3 items from 32 keys on). Results:
// the same kernels in the same order a row, so the same bits. Measured on a Zen 4 (2 threads,
// the embedded Q4_1 model, one request, a timer around each linear's parallel region, not
// kept): starting and ending a region cost ~0.8 us a linear and its threads' ends were
// 0.5-1.8 us apart.
struct TeamPlan {
  int threads = 1;
  std::vector<at::Tensor> x, h, normed, act;  // each member's own, [rows, width]
};

// The team's buffers where every layer qualifies (its four linears on the int8 path for these
// rows, no biases, the shapes and norm weights the ops inside a region would otherwise refuse
// there, where an error cannot leave the region), else nothing: the per-linear path runs.
// (A call also needs a contiguous x and to be outside any parallel region: team_fits.)
std::optional<TeamPlan> team_plan(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                  const std::vector<std::optional<at::Tensor>>& biases,
                                  int64_t num_layers, std::optional<at::ScalarType> numerics,
                                  const StepBuffers& b) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || threads > kMaxTeam || num_layers == 0 ||
      x.scalar_type() != kActivationType)
    return std::nullopt;
  const int64_t rows = x.size(0), hidden = x.size(1), gate_up_width = b.gate_up.size(1);
  if (hidden % Vec::kWidth != 0 || gate_up_width % (2 * Vec::kWidth) != 0) return std::nullopt;
  const auto norm_ok = [&](const at::Tensor& n) {
    return n.is_contiguous() && n.numel() == hidden && n.scalar_type() == x.scalar_type();
  };
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + i * kWeightsPerLayer;
    for (int64_t j = 0; j < kBiasesPerLayer; ++j)
      if (biases[i * kBiasesPerLayer + j].has_value()) return std::nullopt;
    const auto takes = [&](const at::Tensor& q, int64_t in, int64_t out) {
      return quant_linear_into_takes(q, rows, in, x.scalar_type(), numerics) && q.size(0) == out;
    };
    if (!norm_ok(w[0]) || !norm_ok(w[5]) || !takes(w[1], hidden, b.qkv.size(1)) ||
        !takes(w[3], b.attn_rows.size(1), hidden) || !takes(w[6], hidden, gate_up_width) ||
        !takes(w[8], gate_up_width / 2, hidden))
      return std::nullopt;
  }
  TeamPlan plan;
  plan.threads = threads;
  for (int t = 0; t < threads; ++t) {
    plan.x.push_back(at::empty({rows, hidden}, x.options()));
    plan.h.push_back(at::empty({rows, hidden}, x.options()));
    plan.normed.push_back(at::empty({rows, hidden}, x.options()));
    plan.act.push_back(at::empty({rows, gate_up_width / 2}, x.options()));
  }
  return plan;
}

// what a call needs, past its plan, to run as a team
bool team_fits(const at::Tensor& x) { return x.is_contiguous() && !at::in_parallel_region(); }

// What a decode call of a row count makes and can keep for the next (a stack's steps, rows up
// to kFewRows): its StepBuffers, and the team's buffers where the stack runs as one team
// (team_plan's verdict: the weights do not change). Made again where the threads, dtypes or
// shapes differ. A decode loop with the streamed weights leaving every cache cold paid 40-50
// us a step to make them and check the layers, and then to free them (Zen 4, a timer in this
// file, not kept; with the held KV caches the call went from 2,186 to 2,156 us a step, the
// medians of four alternating pairs of runs, the embedded Q4_1 model, one request).
struct StepScratch {
  int64_t rows = -1, width = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, gate_up = 0;
  int threads = 0;
  at::ScalarType dtype = at::kFloat;
  std::optional<at::ScalarType> numerics;
  std::optional<StepBuffers> bufs;
  std::optional<TeamPlan> plan;
};

// The stack's weights and biases, handed over once when the model is loaded and held here, so
// that a step passes one object instead of fourteen tensors a layer. Every tensor argument is
// touched several times a call (its dispatch keys; a reference taken and dropped in Python's
// argument list, the boxed one and the unboxed one), and inside a decode loop, where the
// streamed weights leave every cache cold, SmolLM2's 420 cost about 0.1-0.3 ms a step (Zen 4).
// The KV caches the stack's layers write are handed over the same way (set_kv_caches, once;
// a call that passes none takes them), and they stay alive while the stack holds them.
struct LlamaStackWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<std::optional<at::Tensor>> biases;
  std::vector<at::Tensor> kv_caches;
  std::array<StepScratch, kFewRows + 1> scratch;  // by row count
  std::atomic<bool> scratch_busy{false};          // a call uses `scratch`

  LlamaStackWeights(std::vector<at::Tensor> w, const c10::List<std::optional<at::Tensor>>& b)
      : weights(std::move(w)) {
    TORCH_CHECK(weights.size() % kWeightsPerLayer == 0 &&
                    b.size() == weights.size() / kWeightsPerLayer * kBiasesPerLayer,
                "LlamaStackWeights: 10 weights and 4 biases per layer");
    for (size_t i = 0; i < b.size(); ++i) biases.push_back(b.get(i));
  }

  // one cache a layer, [2, blocks, block_size, kv_heads, head_dim], contiguous and alike
  void set_kv_caches(std::vector<at::Tensor> caches) {
    TORCH_CHECK(caches.size() * kWeightsPerLayer == weights.size(),
                "set_kv_caches: one KV cache a layer of the stack");
    for (const at::Tensor& c : caches)
      TORCH_CHECK(c.dim() == 5 && c.is_contiguous() && c.sizes() == caches[0].sizes() &&
                      c.dtype() == caches[0].dtype() && c.device() == caches[0].device(),
                  "set_kv_caches: every layer's KV cache contiguous, shaped and typed alike");
    kv_caches = std::move(caches);
  }
};

// The stack's scratch for one call; a call made while another uses it (two threads on one
// stack) gets its own, as before it was kept.
struct ScratchLease {
  LlamaStackWeights& stack;
  const bool held;
  explicit ScratchLease(LlamaStackWeights& s)
      : stack(s), held(!s.scratch_busy.exchange(true, std::memory_order_acquire)) {}
  ~ScratchLease() {
    if (held) stack.scratch_busy.store(false, std::memory_order_release);
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
};

// `sc` made (again) for these rows, threads, dtypes and shapes, where it was made for others
void prepare_scratch(StepScratch& sc, const at::Tensor& x, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t gate_up,
                     std::optional<at::ScalarType> numerics, const LlamaStackWeights& stack,
                     int64_t num_layers) {
  const int threads = at::get_num_threads();
  if (sc.rows == x.size(0) && sc.width == x.size(1) && sc.num_heads == num_heads &&
      sc.num_kv_heads == num_kv_heads && sc.head_dim == head_dim && sc.gate_up == gate_up &&
      sc.threads == threads && sc.dtype == x.scalar_type() && sc.numerics == numerics)
    return;
  sc = StepScratch{};
  sc.bufs = step_buffers(x, num_heads, num_kv_heads, head_dim, gate_up);
  if (sc.bufs)
    sc.plan = team_plan(x, stack.weights, stack.biases, num_layers, numerics, *sc.bufs);
  sc.rows = x.size(0);
  sc.width = x.size(1);
  sc.num_heads = num_heads;
  sc.num_kv_heads = num_kv_heads;
  sc.head_dim = head_dim;
  sc.gate_up = gate_up;
  sc.threads = threads;
  sc.dtype = x.scalar_type();
  sc.numerics = numerics;
}

// `body(member, size)` on every thread of one parallel region
template <typename F>
void team_region(int threads, const F& body) {
#pragma omp parallel num_threads(threads)
  body(omp_get_thread_num(), omp_get_num_threads());
}

at::Tensor team_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, const LlamaStackWeights& stack,
                       at::TensorList kv_caches, const at::Tensor& slot_mapping,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, double eps, double scale, int64_t* timer,
                       StepBuffers& b, TeamPlan& plan, bool caches_checked) {
  const int64_t num_layers = int64_t(kv_caches.size());
  const std::vector<at::Tensor>& weights = stack.weights;
  AttentionPlan attention;
  plan_attention(attention, b.attn, b.q, kv_caches[0], block_tables, query_start_loc, seq_lens,
                 plan.threads);
  if (!caches_checked)  // (the stack's held caches were checked when handed over)
    for (const at::Tensor& c : kv_caches)
      TORCH_CHECK(c.sizes() == kv_caches[0].sizes() && c.dtype() == kv_caches[0].dtype() &&
                      c.is_contiguous(),
                  "llama_layers: every layer's KV cache shaped and typed alike");
  QuantTeam team;
  // the cache write's errors (a slot out of range), raised once the region has ended
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  team_region(plan.threads, [&](int t, int n) {
    rms_norm_into(plan.normed[t], x_in, weights[0], eps);
    quant_linear_team(b.qkv, plan.normed[t], weights[1], team, t, n);
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor* w = weights.data() + i * kWeightsPerLayer;
      team.barrier(n);  // QKV whole
      const auto start = std::chrono::steady_clock::now();
      if (t == 0) {
        try {
          rotary_embedding_into(b.q, b.q_rows, b.k, positions, cos, sin);
          at::Tensor kv_cache = kv_caches[i];
          write_kv(kv_cache, b.k, b.v, slot_mapping);
        } catch (...) {
          error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
        attention.next.store(0, std::memory_order_relaxed);
      }
      team.barrier(n);
      if (failed.load(std::memory_order_relaxed)) return;
      attend_items(attention, b.attn, b.q, kv_caches[i], block_tables, query_start_loc,
                   seq_lens, scale);
      if (!attention.merges.empty()) {
        team.barrier(n);
        if (t == 0) merge_attention(attention, b.attn);
      }
      team.barrier(n);
      if (t == 0) add_elapsed(timer, start);
      if (i + 1 < num_layers) prefetch_kv(kv_caches[i + 1], block_tables, seq_lens, t, n);
      const at::Tensor& x = i == 0 ? x_in : plan.x[t];
      quant_linear_team(b.h, b.attn_rows, w[3], team, t, n);
      team.barrier(n);
      add_into(plan.h[t], b.h, x);  // h = x + o_proj(attn), each member's own
      rms_norm_into(plan.normed[t], plan.h[t], w[5], eps);
      quant_linear_team(b.gate_up, plan.normed[t], w[6], team, t, n);
      team.barrier(n);
      silu_and_mul_into(plan.act[t], b.gate_up);
      quant_linear_team(b.out, plan.act[t], w[8], team, t, n);
      team.barrier(n);
      add_into(plan.x[t], b.out, plan.h[t]);
      if (i + 1 == num_layers) return;
      rms_norm_into(plan.normed[t], plan.x[t], w[kWeightsPerLayer], eps);
      quant_linear_team(b.qkv, plan.normed[t], w[kWeightsPerLayer + 1], team, t, n);
    }
  });
  if (error) std::rethrow_exception(error);
  return plan.x[0];
}

// A step's ends, folded into the call where the model asks (LlamaModel.forward): the
// input rows looked up in the embedding table (in the table's dtype, widened to the
// activations' where they differ, as the table's .to() would), and the final norm applied to
// the output in the table's dtype. The same kernels and roundings as the Python ops they
// replace (an embedding lookup, then rms_norm on the stack's output rounded to the model's
// dtype), so the same bits; what goes is two ops' dispatch from Python, which inside a decode
// loop (caches cold from the streamed weights) cost 60-80 us a step on a Zen 4.
at::Tensor embedding_rows(const at::Tensor& ids, const at::Tensor& table) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.is_contiguous(),
              "llama_layers: embed_ids [tokens] int64 and a contiguous embed_table "
              "[vocab, hidden]");
  const int64_t n = ids.size(0), vocab = table.size(0), hidden = table.size(1);
  at::Tensor rows = at::empty({n, hidden}, table.options());
  const at::Tensor ids_c = ids.contiguous();  // (kept: the pointer below reads it)
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t row_bytes = hidden * table.element_size();
  const char* from = static_cast<const char*>(table.data_ptr());
  char* to = static_cast<char*>(rows.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "llama_layers: token id ", id[i],
                " outside the embedding table's ", vocab, " rows");
    std::memcpy(to + i * row_bytes, from + id[i] * row_bytes, size_t(row_bytes));
  }
  return rows;
}

// the final norm where the call runs it, in its weight's dtype (the model's)
at::Tensor finish_step(at::Tensor out, const std::optional<at::Tensor>& final_norm, double eps) {
  if (!final_norm.has_value()) return out;
  if (out.scalar_type() != final_norm->scalar_type()) out = out.to(final_norm->scalar_type());
  return rms_norm(out, *final_norm, eps);
}

// Every decoder layer in one call; with embed_ids / embed_table / final_norm (the step's ends,
// above), x_or_ids is a placeholder and the call runs from token ids to the final norm's output.
at::Tensor llama_layers(const at::Tensor& x_or_ids, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin,
                        const c10::intrusive_ptr<LlamaStackWeights>& stack,
                        at::TensorList kv_caches_arg, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, double eps, double scale, int64_t num_heads,
                        int64_t num_kv_heads, at::TensorList lora_weights,
                        const std::optional<at::Tensor>& lora_slots,
                        const std::optional<at::Tensor>& attention_ns,
                        const std::optional<at::Tensor>& tp_segment,
                        const std::optional<at::Tensor>& tp_state,
                        std::optional<at::ScalarType> model_dtype,
                        const std::optional<at::Tensor>& embed_ids,
                        const std::optional<at::Tensor>& embed_table,
                        const std::optional<at::Tensor>& final_norm) {
  TORCH_CHECK(embed_ids.has_value() == embed_table.has_value(),
              "llama_layers: embed_ids and embed_table come together");
  const at::Tensor x_in = embed_table.has_value()
                              ? embedding_rows(*embed_ids, *embed_table).to(kActivationType)
                              : x_or_ids;
  // no caches passed: the ones the stack holds (set_kv_caches)
  const bool held_caches = kv_caches_arg.empty() && !stack->kv_caches.empty();
  const at::TensorList kv_caches = held_caches ? at::TensorList(stack->kv_caches) : kv_caches_arg;
  const int64_t num_layers = int64_t(kv_caches.size());
  const std::vector<at::Tensor>& weights = stack->weights;
  TORCH_CHECK(int64_t(weights.size()) == num_layers * kWeightsPerLayer,
              "llama_layers: the stack's layers and the KV caches differ in number");
  int64_t* timer = nullptr;
  if (attention_ns.has_value()) {
    TORCH_CHECK(attention_ns->scalar_type() == at::kLong && attention_ns->numel() == 1,
                "llama_layers: attention_ns must be one int64");
    timer = attention_ns->data_ptr<int64_t>();
  }
  LoRAGroups groups;
  if (lora_slots.has_value()) {
    TORCH_CHECK(int64_t(lora_weights.size()) == num_layers * kLoRAPerLayer,
                "llama_layers: 8 LoRA tensors per layer");
    for (const at::Tensor& w : lora_weights)
      TORCH_CHECK(w.scalar_type() == kActivationType,
                  "llama_layers: the LoRA stacks must be in the activations' dtype");
    TORCH_CHECK(lora_slots->size(0) == x_in.size(0), "llama_layers: one LoRA slot per token");
    groups = lora_groups(lora_slots->contiguous(), lora_weights[0].size(0));
  }
  const bool with_lora = lora_slots.has_value() && !groups.slots.empty();
  TORCH_CHECK(tp_segment.has_value() == tp_state.has_value(),
              "llama_layers: tp_segment and tp_state come together");
  std::optional<ShmGroup> tp;
  if (tp_segment.has_value()) tp = shm_group(*tp_segment, *tp_state);
  const ScratchLease lease(*stack);
  StepScratch own;  // where the stack's scratch is in another call's use
  StepBuffers* step = nullptr;
  TeamPlan* plan = nullptr;
  if (x_in.size(0) <= kFewRows && !with_lora && !tp && num_layers > 0) {
    StepScratch& sc = lease.held ? stack->scratch[x_in.size(0)] : own;
    prepare_scratch(sc, x_in, num_heads, num_kv_heads, cos.size(1), out_features(weights[7]),
                    model_dtype, *stack, num_layers);
    if (sc.bufs) step = &*sc.bufs;
    if (sc.plan && team_fits(x_in)) plan = &*sc.plan;
  }
  // the output, never a kept buffer (the next call would write it)
  const auto result = [&](const at::Tensor& out) {
    return final_norm.has_value() ? finish_step(out, final_norm, eps)
                                  : (step != nullptr && lease.held ? out.clone() : out);
  };
  if (plan != nullptr) {
    team_calls.fetch_add(1, std::memory_order_relaxed);
    return result(team_layers(x_in, positions, cos, sin, *stack, kv_caches, slot_mapping,
                              block_tables, query_start_loc, seq_lens, eps, scale, timer, *step,
                              *plan, held_caches));
  }
  at::Tensor x = x_in;
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + i * kWeightsPerLayer;
    const auto bias = [&](int64_t j) -> const std::optional<at::Tensor>& {
      return stack->biases[i * kBiasesPerLayer + j];
    };
    const int64_t head_dim = cos.size(1);
    std::optional<LoRAProjection> qkv_lora;
    std::vector<LoRAProjection> mlp_lora;  // o, gate/up, down
    if (with_lora) {
      const at::Tensor* l = lora_weights.data() + i * kLoRAPerLayer;
      qkv_lora.emplace(LoRAProjection{&l[0], &l[1], &groups,
                                      {num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim}});
      const int64_t width = l[5].size(2) / 2;
      mlp_lora = {LoRAProjection{&l[2], &l[3], &groups, {}},
                  LoRAProjection{&l[4], &l[5], &groups, {width, width}},
                  LoRAProjection{&l[6], &l[7], &groups, {}}};
    }
    auto [q, k, v] = norm_qkv_rope_lora(x, w[0], eps, w[1], w[2], bias(0), positions, cos, sin,
                                        num_heads, num_kv_heads,
                                        qkv_lora ? &*qkv_lora : nullptr, model_dtype, step);
    at::Tensor attn = step ? step->attn : at::empty({x.size(0), num_heads, q.size(2)}, x.options());
    attend_layer(attn, q.contiguous(), k, v, kv_caches, i, slot_mapping, block_tables,
                 query_start_loc, seq_lens, scale, timer);
    x = residual_mlp_lora(x, step ? step->attn_rows : attn.view({x.size(0), -1}), w[3], w[4],
                          bias(1), w[5], eps, w[6], w[7], bias(2), w[8], w[9], bias(3),
                          mlp_lora.empty() ? nullptr : mlp_lora.data(), tp ? &*tp : nullptr,
                          model_dtype, step);
  }
  return result(x);
}

}  // namespace

#define QUIRE_STRINGIFY_(x) #x
#define QUIRE_STRINGIFY(x) QUIRE_STRINGIFY_(x)

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.class_<LlamaStackWeights>("LlamaStackWeights")
      .def(torch::init<std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>>())
      .def("set_kv_caches", &LlamaStackWeights::set_kv_caches);
  m.def("llama_layers(Tensor x, Tensor positions, Tensor cos, Tensor sin, "
        "__torch__.torch.classes." QUIRE_STRINGIFY(QUIRE_NS) ".LlamaStackWeights stack, "
        "Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float eps, float scale, int num_heads, "
        "int num_kv_heads, Tensor[] lora_weights, Tensor? lora_slots, "
        "Tensor(b!)? attention_ns=None, Tensor(c!)? tp_segment=None, Tensor(d!)? tp_state=None, "
        "ScalarType? model_dtype=None, Tensor? embed_ids=None, Tensor? embed_table=None, "
        "Tensor? final_norm=None) -> Tensor");
  // how many llama_layers calls so far ran as one team (team_layers)
  m.def("layer_team_calls() -> int", &layer_team_calls);
  m.def("norm_qkv_rope(Tensor x, Tensor norm_weight, float eps, Tensor qkv_skinny, "
        "Tensor qkv_onednn, Tensor? qkv_bias, Tensor positions, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("residual_mlp(Tensor x, Tensor attn, Tensor o_skinny, Tensor o_onednn, Tensor? o_bias, "
        "Tensor norm_weight, float eps, Tensor gate_up_skinny, Tensor gate_up_onednn, "
        "Tensor? gate_up_bias, Tensor down_skinny, Tensor down_onednn, Tensor? down_bias) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("norm_qkv_rope", &norm_qkv_rope);
  m.impl("residual_mlp", &residual_mlp);
  m.impl("llama_layers", &llama_layers);
}

// oneDNN's packed weights are MkldnnCPU tensors, which the dispatcher ranks above CPU.
TORCH_LIBRARY_IMPL(QUIRE_NS, MkldnnCPU, m) {
  m.impl("norm_qkv_rope", &norm_qkv_rope);
  m.impl("residual_mlp", &residual_mlp);
  m.impl("llama_layers", &llama_layers);
}

}  // namespace QUIRE_NS
