// The paged attention (paged_attention.h), built without AVX-512 flags: the dispatch to the project's kernel and the
// portable loop. The loop: one task per (query row, head); tasks are spread over libtorch's intra-op threads only
// when they hold enough work, since a parallel region costs more than a short context.
#include "paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "q4_weights.h"

namespace pocket {

namespace {

constexpr int64_t kKernelRows = 32;   // rows per call of the kernel: its per-call buffers grow with rows x length

}  // namespace

bool paged_attention_avx512_supported(int64_t H, int64_t KVH, int64_t D) {
  static const bool cpu = q4_kernel_supported();   // the same instructions as the 4-bit kernel
  const int64_t G = KVH > 0 && H % KVH == 0 ? H / KVH : 0;
  return cpu && (D == 16 || D == 32 || D == 64 || D == 128) && G >= 1 && G <= 8;
}

namespace {

// One query row and head over positions 0 .. length - 1 of its KV head, built for three targets (the widest the CPU
// runs is picked at load). The dot products are SIMD reductions in an order of the compiler's choosing, the same
// for every row, so a row's result never depends on its batch.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_row(const float* qv, const float* k_cache, const float* v_cache, const int64_t* slots, int64_t length,
                int64_t KVH, int64_t kvh, int64_t D, float scale, float* scores, float* o) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < length; ++p) {
    const float* kv = k_cache + (slots[p] * KVH + kvh) * D;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
    scores[p] = dot * scale;
    best = std::max(best, scores[p]);
  }
  float total = 0.f;
  for (int64_t p = 0; p < length; ++p) total += scores[p] = std::exp(scores[p] - best);
  std::fill(o, o + D, 0.f);
  for (int64_t p = 0; p < length; ++p) {
    const float w = scores[p] / total;
    const float* vv = v_cache + (slots[p] * KVH + kvh) * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += w * vv[d];
  }
}

}  // namespace

void paged_attention(const float* q, const at::Tensor& k_tensor, const at::Tensor& v_tensor, float* out,
                     const std::vector<AttentionChunk>& chunks, int64_t H, int64_t KVH, int64_t D, float scale) {
  if (paged_attention_avx512_supported(H, KVH, D)) {
    // Each row's length and slots; the kernel's result for a row depends on neither the other rows nor the grouping.
    std::vector<int64_t> lengths;
    std::vector<const int64_t*> slots;
    const int64_t first = chunks.empty() ? 0 : chunks.front().row0;
    for (const AttentionChunk& c : chunks) {
      if (c.row0 != first + static_cast<int64_t>(lengths.size()))
        throw std::logic_error("paged_attention: chunks' rows must follow each other");
      for (int64_t i = 0; i < c.n; ++i) {
        lengths.push_back(c.start + i + 1);   // causal: positions 0 .. start + i
        slots.push_back(c.slots);
      }
    }
    const int64_t rows = static_cast<int64_t>(lengths.size());
    for (int64_t r = 0; r < rows; r += kKernelRows) {
      const int64_t n = std::min(kKernelRows, rows - r);
      paged_attention_avx512(q + (first + r) * H * D, k_tensor, v_tensor, out + (first + r) * H * D,
                             lengths.data() + r, slots.data() + r, n, H, KVH, D, scale);
    }
    return;
  }
  const float* k_cache = k_tensor.data_ptr<float>();
  const float* v_cache = v_tensor.data_ptr<float>();
  struct Item {
    const AttentionChunk* chunk;
    int64_t i;   // row within the chunk
  };
  std::vector<Item> rows;
  int64_t work = 0;
  for (const AttentionChunk& c : chunks)
    for (int64_t i = 0; i < c.n; ++i) {
      rows.push_back({&c, i});
      work += (c.start + i + 1) * D * H;
    }
  const int64_t tasks = static_cast<int64_t>(rows.size()) * H;
  if (tasks == 0) return;
  const int64_t per_task = std::max<int64_t>(1, work / tasks);
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / per_task);   // ~256K multiply-adds per thread at least
  const int64_t G = H / KVH;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const Item& item = rows[t / H];
      const int64_t h = t % H, kvh = h / G;
      const int64_t row = item.chunk->row0 + item.i;
      const int64_t length = item.chunk->start + item.i + 1;   // causal: positions 0 .. start + i
      scores.resize(length);
      attend_row(q + (row * H + h) * D, k_cache, v_cache, item.chunk->slots, length, KVH, kvh, D, scale,
                 scores.data(), out + (row * H + h) * D);
    }
  });
}

}  // namespace pocket
