// The shared-memory all-reduce of a tensor-parallel group on one host, in C++ so the fused
// layer stack (llama_block.cpp) can sum its row-parallel outputs between layers without
// coming back to Python. The segment is the one engine_worker/distributed/shm.py maps and
// lays out, and both sides keep one sequence number (the state tensor), so Python's
// collectives (the embedding's all-reduce, the logits' gather) and these interleave:
//
//   segment: world_size cache lines of int64 [flag, pid, 0...], then two buffers of
//            world_size slots of slot_bytes each
//   state:   int64 [seq, rank, world_size, slot_bytes]
//
// One round: write this rank's part into its slot of buffer seq % 2, publish seq in its flag
// (release), wait until every flag has reached seq (acquire), then sum every slot in rank
// order, so every rank gets the same bits (fp32: left to right; bf16 / fp16: two parts
// rounded once from their fp32 sum, as torch adds them; more parts summed in fp32 and
// rounded once). Two buffers make one wait per round enough (shm.py says why). A tensor
// larger than a slot goes in slot-sized rounds. A wait that finds a peer's process gone (its
// pid has no /proc entry, or is a zombie) fails instead of spinning forever.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int64_t kFlagStride = 8;  // int64s: one cache line per rank
constexpr int64_t kSpinsBeforeYield = 64;

// false when the process is gone or a zombie (exited, not yet reaped by its parent)
bool process_alive(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[256];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return paren == nullptr || paren[1] == '\0' || (paren[2] != 'Z' && paren[2] != 'X');
}

void check_peers(const ShmGroup& g) {
  for (int64_t r = 0; r < g.world_size; ++r) {
    if (r == g.rank) continue;
    const int64_t pid = __atomic_load_n(g.flags + r * kFlagStride + 1, __ATOMIC_RELAXED);
    TORCH_CHECK(pid <= 0 || process_alive(pid),
                "shared-memory all-reduce aborted: tensor-parallel rank ", r, " (pid ", pid,
                ") exited");
  }
}

void wait_for_all(const ShmGroup& g, int64_t seq) {
  for (int64_t spins = 0;; ++spins) {
    bool done = true;
    for (int64_t r = 0; r < g.world_size && done; ++r)
      done = __atomic_load_n(g.flags + r * kFlagStride, __ATOMIC_ACQUIRE) >= seq;
    if (done) return;
    if (spins < kSpinsBeforeYield) {
      _mm_pause();
      continue;
    }
    sched_yield();  // ranks may share cores: let the one we wait for run
    if (spins % 1024 == 0) {
      check_peers(g);
      if (spins > (1 << 16)) usleep(500);  // a long wait (a peer in a long step)
    }
  }
}

template <typename T>
void sum_parts(T* out, const uint8_t* buffer, int64_t slot_bytes, int64_t world_size,
               int64_t n) {
  const auto part = [&](int64_t r) {
    return reinterpret_cast<const T*>(buffer + r * slot_bytes);
  };
  if (std::is_same_v<T, float> || world_size == 2) {
    const T* a = part(0);
    const T* b = part(1);
    for (int64_t i = 0; i < n; ++i) out[i] = T(float(a[i]) + float(b[i]));
    for (int64_t r = 2; r < world_size; ++r) {  // fp32 only (narrow types: below)
      const T* c = part(r);
      for (int64_t i = 0; i < n; ++i) out[i] = T(float(out[i]) + float(c[i]));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float acc = float(part(0)[i]);
    for (int64_t r = 1; r < world_size; ++r) acc += float(part(r)[i]);
    out[i] = T(acc);
  }
}

}  // namespace

ShmGroup shm_group(const at::Tensor& segment, const at::Tensor& state) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 4 && state.is_contiguous(),
              "shm_all_reduce: state must be int64 [seq, rank, world_size, slot_bytes]");
  int64_t* s = state.data_ptr<int64_t>();
  ShmGroup g;
  g.seq = s;
  g.rank = s[1];
  g.world_size = s[2];
  g.slot_bytes = s[3];
  TORCH_CHECK(g.world_size >= 2 && g.rank >= 0 && g.rank < g.world_size && g.slot_bytes > 0,
              "shm_all_reduce: a bad state");
  const int64_t flag_bytes = g.world_size * kFlagStride * 8;
  TORCH_CHECK(segment.scalar_type() == at::kByte && segment.is_contiguous() &&
                  segment.numel() == flag_bytes + 2 * g.world_size * g.slot_bytes,
              "shm_all_reduce: the segment is not the size its state says");
  g.flags = reinterpret_cast<int64_t*>(segment.data_ptr<uint8_t>());
  g.slots = segment.data_ptr<uint8_t>() + flag_bytes;
  return g;
}

void shm_all_reduce(at::Tensor& x, const ShmGroup& g) {
  TORCH_CHECK(x.is_contiguous(), "shm_all_reduce: x must be contiguous");
  const int64_t elem = x.element_size(), total = x.numel();
  const int64_t per_round = g.slot_bytes / elem;
  uint8_t* data = static_cast<uint8_t*>(x.data_ptr());
  for (int64_t start = 0; start < total; start += per_round) {
    const int64_t n = std::min(per_round, total - start);
    const int64_t seq = ++*g.seq;
    uint8_t* buffer = g.slots + (seq & 1) * g.world_size * g.slot_bytes;
    std::memcpy(buffer + g.rank * g.slot_bytes, data + start * elem, n * elem);
    __atomic_store_n(g.flags + g.rank * kFlagStride, seq, __ATOMIC_RELEASE);
    wait_for_all(g, seq);
    QUIRE_DISPATCH(x.scalar_type(), "shm_all_reduce",
                   sum_parts<T>(reinterpret_cast<T*>(data) + start, buffer, g.slot_bytes,
                                g.world_size, n));
  }
}

namespace {

void shm_all_reduce_op(at::Tensor& x, const at::Tensor& segment, const at::Tensor& state) {
  shm_all_reduce(x, shm_group(segment, state));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("shm_all_reduce(Tensor(a!) x, Tensor(b!) segment, Tensor(c!) state) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) { m.impl("shm_all_reduce", &shm_all_reduce_op); }

}  // namespace QUIRE_NS
