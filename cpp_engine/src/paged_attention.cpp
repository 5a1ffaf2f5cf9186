// The paged attention (paged_attention.h). The portable loop: one task per (query row, head); tasks are spread over libtorch's
// intra-op threads only when they hold enough work, since a parallel region costs more than a short context.
#include "paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace pocket {

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
  if (paged_attention_avx512_supported(H, KVH, D))
    return paged_attention_avx512(q, k_tensor, v_tensor, out, chunks, H, KVH, D, scale);
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
