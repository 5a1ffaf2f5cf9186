// paged_attention_aten (paged_attention.h): the attention of a device without the CPU loops.
#include <limits>

#include "paged_attention.h"

namespace pocket {

void paged_attention_aten(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& out, const std::vector<AttentionChunk>& chunks,
                          const at::Tensor& context_slots, float scale) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH;
  const at::Device device = q.device();
  for (const AttentionChunk& ch : chunks) {
    const int64_t length = ch.start + ch.n;   // the chunk's context: positions 0 .. length - 1
    at::Tensor slots = context_slots.narrow(0, ch.offset, length);
    at::Tensor keys = k_cache.index_select(0, slots);     // [L, KVH, D]
    at::Tensor values = v_cache.index_select(0, slots);   // [L, KVH, D]
    // Query heads grouped by their KV head: [KVH, G, n, D] against [KVH, D, L].
    at::Tensor qc = q.narrow(0, ch.row0, ch.n).view({ch.n, KVH, G, D}).permute({1, 2, 0, 3});
    at::Tensor scores = at::matmul(qc, keys.permute({1, 2, 0}).unsqueeze(1)) * scale;   // [KVH, G, n, L]
    // Row i (position start + i) sees positions 0 .. start + i.
    at::Tensor rows = at::arange(ch.start, length, at::TensorOptions().dtype(at::kLong).device(device));
    at::Tensor cols = at::arange(length, at::TensorOptions().dtype(at::kLong).device(device));
    at::Tensor hidden = cols.unsqueeze(0) > rows.unsqueeze(1);   // [n, L]
    scores.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1);
    at::Tensor o = at::matmul(probs, values.permute({1, 0, 2}).unsqueeze(1));   // [KVH, G, n, D]
    out.narrow(0, ch.row0, ch.n).copy_(o.permute({2, 0, 1, 3}).reshape({ch.n, H, D}));
  }
}

}  // namespace pocket
