// The 4-bit decode layer (q4_decode_layer.h); compiled with the AVX-512 flags of the project's kernels.
#include "q4_decode_layer.h"

#include "cpu_kernels.h"

namespace pocket {

bool q4_layer_supported(const Q4LayerShape& s) {
  return s.hidden % 16 == 0 && s.head_dim % 16 == 0 && s.intermediate % 16 == 0 && s.heads % s.kv_heads == 0;
}

void q4_decode_layer(float* x, int64_t T, const Q4LayerWeights& w, const Q4LayerShape& s, const float* cos,
                     const float* sin, const int64_t* slots, at::Tensor& k_cache, at::Tensor& v_cache,
                     const std::vector<AttentionChunk>& views, Q4LayerScratch& scratch) {
  using pocketllm_cpu::rms_norm_rows;
  const int64_t H = s.heads, KVH = s.kv_heads, D = s.head_dim, hidden = s.hidden, inter = s.intermediate;
  const int64_t qw = H * D, kvw = KVH * D, qkv_n = qw + 2 * kvw;
  float* normed = scratch.normed.data();
  float* qkv = scratch.qkv.data();
  float* q = scratch.q.data();
  float* attended = scratch.attended.data();
  float* projected = scratch.projected.data();
  float* gate_up = scratch.gate_up.data();
  float* activated = scratch.activated.data();
  uint8_t* products = scratch.products.data();

  rms_norm_rows(x, T, hidden, w.input_norm.data_ptr<float>(), s.eps, normed);
  pocketllm_cpu::q4_matmul(normed, T, w.qkv_q4, qkv, products);
  if (w.qkv_bias.defined()) {
    for (int64_t r = 0; r < T; ++r) pocketllm_cpu::add_into(qkv + r * qkv_n, w.qkv_bias.data_ptr<float>(), qkv_n);
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) {
    float* row = qkv + r * qkv_n;
    if (w.q_norm.defined()) {   // per-head RMSNorm of q and k (Qwen3), in place before the rotation
      rms_norm_rows(row, H, D, w.q_norm.data_ptr<float>(), s.eps, row);
      rms_norm_rows(row + qw, KVH, D, w.k_norm.data_ptr<float>(), s.eps, row + qw);
    }
    pocketllm_cpu::rotate_heads(row, H, D, cos + r * D, sin + r * D, q + r * qw);
    pocketllm_cpu::rotate_heads(row + qw, KVH, D, cos + r * D, sin + r * D, kc + slots[r] * kvw);
    std::copy(row + qw + kvw, row + qkv_n, vc + slots[r] * kvw);
  }
  paged_attention(q, k_cache, v_cache, attended, views, H, KVH, D, s.scale);
  pocketllm_cpu::q4_matmul(attended, T, w.o_proj_q4, projected, products);
  pocketllm_cpu::add_into(x, projected, T * hidden);

  rms_norm_rows(x, T, hidden, w.post_norm.data_ptr<float>(), s.eps, normed);
  pocketllm_cpu::q4_matmul(normed, T, w.gate_up_q4, gate_up, products);
  pocketllm_cpu::silu_mul_rows(gate_up, T, inter, activated);
  pocketllm_cpu::q4_matmul(activated, T, w.down_q4, projected, products);
  pocketllm_cpu::add_into(x, projected, T * hidden);
}

}  // namespace pocket
