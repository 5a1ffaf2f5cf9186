// The LM head's rescoring on CPU (pocketllm/layers/quantized_linear.py, RescoredLMHead): for each row of a
// quantised head's logits, the `count` highest are recomputed as exact float32 dot products of the row's hidden
// state with the head's float weights. One call instead of torch's topk, index_select and bmm (those spent about
// 0.2 ms a row on SmolLM2's 49,152-token head, more than a quarter of the 8-bit product itself).
//
// The top `count` of a row: the maxima of blocks of 64 logits, the `count`-th largest of those as a threshold
// (at least `count` logits reach it), then a selection among the logits that reach it. Each row is computed on
// its own, so its result does not depend on the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifndef POCKETLLM_NO_TORCH_OPS
#include <torch/library.h>
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace pocketllm_cpu {
namespace {

constexpr int64_t kSpan = 64;   // logits per block maximum

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The indices of the `count` largest of `values[0, n)` (count <= n), in no particular order.
std::vector<int64_t> top_indices(const float* values, int64_t n, int64_t count, std::vector<float>& maxima,
                                 std::vector<std::pair<float, int64_t>>& candidates) {
  const int64_t blocks = (n + kSpan - 1) / kSpan;
  maxima.resize(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kSpan, end = std::min(n, begin + kSpan);
    float best = values[begin];
    int64_t i = begin;
    if (end - begin == kSpan) {
      __m512 m = load16(values + begin);
      for (i = begin + 16; i < end; i += 16) m = _mm512_max_ps(m, load16(values + i));
      best = _mm512_reduce_max_ps(m);
    }
    for (; i < end; ++i) best = std::max(best, values[i]);
    maxima[b] = best;
  }
  const int64_t rank = std::min(count, blocks);
  std::nth_element(maxima.begin(), maxima.begin() + (rank - 1), maxima.end(), std::greater<float>());
  const float threshold = maxima[rank - 1];   // `rank` blocks reach it; with count > blocks, every logit does
  candidates.clear();
  if (count > blocks) {
    for (int64_t i = 0; i < n; ++i) candidates.emplace_back(values[i], i);
  } else {
    const __m512 t = _mm512_set1_ps(threshold);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __mmask16 hit = _mm512_cmp_ps_mask(load16(values + i), t, _CMP_GE_OQ);
      while (hit != 0) {
        const int lane = __builtin_ctz(hit);
        candidates.emplace_back(values[i + lane], i + lane);
        hit &= static_cast<__mmask16>(hit - 1);
      }
    }
    for (; i < n; ++i) {
      if (values[i] >= threshold) candidates.emplace_back(values[i], i);
    }
  }
  // Largest first; among equal logits the lower index first (as a sort by value then index would order them).
  auto before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::nth_element(candidates.begin(), candidates.begin() + (count - 1), candidates.end(), before);
  std::vector<int64_t> out(static_cast<size_t>(count));
  for (int64_t j = 0; j < count; ++j) out[j] = candidates[j].second;
  return out;
}

// sum_k x[k] * w[k] in float32, sixteen lanes then their sum (h a multiple of 16).
template <typename T>
float dot(const float* x, const T* w, int64_t h) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < h; k += 16) acc = _mm512_fmadd_ps(load16(x + k), load16(w + k), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
void rescore_rows(float* logits, int64_t rows, int64_t n, const float* x, int64_t h, const T* weight,
                  int64_t w_stride, int64_t count) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> maxima;
    std::vector<std::pair<float, int64_t>> candidates;
    for (int64_t r = begin; r < end; ++r) {
      float* row = logits + r * n;
      const std::vector<int64_t> top = top_indices(row, n, count, maxima, candidates);
      for (const int64_t i : top) row[i] = dot<T>(x + r * h, weight + i * w_stride, h);
    }
  });
}

}  // namespace

void rescore_top_rows(float* logits, int64_t rows, int64_t n, const float* x, int64_t h, const float* weight,
                      int64_t w_stride, int64_t count) {
  rescore_rows<float>(logits, rows, n, x, h, weight, w_stride, count);
}

#ifndef POCKETLLM_NO_TORCH_OPS   // the native plane (cpp_engine) calls rescore_top_rows directly
namespace {

at::Tensor rescore_top(at::Tensor logits, const at::Tensor& x, const at::Tensor& weight, int64_t count) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "rescore_top: logits must be contiguous float32 [R, V]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == logits.size(0),
              "rescore_top: x must be contiguous float32 [R, H]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= logits.size(1) && weight.size(1) == x.size(1) &&
              weight.stride(1) == 1 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "rescore_top: weight must be float32 or bfloat16 [>= V, H] with contiguous rows");
  TORCH_CHECK(x.size(1) % 16 == 0, "rescore_top: the hidden size must be a multiple of 16");
  TORCH_CHECK(count >= 1 && count <= logits.size(1), "rescore_top: count must be in [1, V]");
  if (logits.size(0) == 0) return logits;
  const int64_t rows = logits.size(0), n = logits.size(1), h = x.size(1);
  if (weight.scalar_type() == at::kFloat) {
    rescore_rows<float>(logits.data_ptr<float>(), rows, n, x.data_ptr<float>(), h, weight.data_ptr<float>(),
                        weight.stride(0), count);
  } else {
    rescore_rows<at::BFloat16>(logits.data_ptr<float>(), rows, n, x.data_ptr<float>(), h,
                               weight.data_ptr<at::BFloat16>(), weight.stride(0), count);
  }
  return logits;
}

}  // namespace
#endif  // POCKETLLM_NO_TORCH_OPS
}  // namespace pocketllm_cpu

#ifndef POCKETLLM_NO_TORCH_OPS
TORCH_LIBRARY_FRAGMENT(pocketllm_cpu, m) {
  m.def("rescore_top(Tensor(a!) logits, Tensor x, Tensor weight, int count) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pocketllm_cpu, CPU, m) {
  m.impl("rescore_top", &pocketllm_cpu::rescore_top);
}
#endif  // POCKETLLM_NO_TORCH_OPS
