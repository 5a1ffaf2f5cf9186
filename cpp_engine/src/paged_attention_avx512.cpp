// The paged attention through the project's decode attention kernel (pocketllm/kernels/cpu/decode_attention.cpp,
// compiled into this plane without its op registration), reading each row's keys and values at its slots in place.
#include <stdexcept>
#include <vector>

#include "cpu_kernels.h"
#include "paged_attention.h"
#include "q4_weights.h"

namespace pocket {

bool paged_attention_avx512_supported(int64_t H, int64_t KVH, int64_t D) {
  static const bool cpu = q4_kernel_supported();   // the same instructions as the 4-bit kernel
  const int64_t G = KVH > 0 && H % KVH == 0 ? H / KVH : 0;
  return cpu && (D == 16 || D == 32 || D == 64 || D == 128) && G >= 1 && G <= 8;
}

void paged_attention_avx512(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, float* out,
                            const std::vector<AttentionChunk>& chunks, int64_t H, int64_t KVH, int64_t D,
                            float scale) {
  std::vector<int64_t> lengths;
  std::vector<const int64_t*> slots;
  for (const AttentionChunk& c : chunks) {
    if (c.row0 != chunks.front().row0 + static_cast<int64_t>(lengths.size()))
      throw std::logic_error("paged_attention: chunks' rows must follow each other");
    for (int64_t i = 0; i < c.n; ++i) {
      lengths.push_back(c.start + i + 1);   // causal: positions 0 .. start + i
      slots.push_back(c.slots);
    }
  }
  const int64_t rows = static_cast<int64_t>(lengths.size());
  if (rows == 0) return;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Rows are in chunk order, chunk c's from row0: the views' rows are consecutive from 0.
  const int64_t first = chunks.front().row0;
  const at::Tensor qt = at::from_blob(const_cast<float*>(q) + first * H * D, {rows, KVH, H / KVH, D}, f32);
  at::Tensor ot = at::from_blob(out + first * H * D, {rows, KVH, H / KVH, D}, f32);
  pocketllm_cpu::attend_paged(qt, k_cache, v_cache, lengths.data(), slots.data(), scale, ot);
}

}  // namespace pocket
