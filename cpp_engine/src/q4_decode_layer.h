// One dense decoder layer (Llama, Qwen2, Qwen3) of a 4-bit decode step on raw buffers: the project's row
// operations (pocketllm/kernels/cpu/cpu_kernels.h) around the 4-bit products and the paged attention, where the
// generic forward runs about fifteen libtorch ops a layer.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "paged_attention.h"

namespace pocket {

// A layer's weights as the step reads them: float32 norms and bias (bias, q_norm, k_norm may be undefined) and the
// 4-bit records of its four products.
struct Q4LayerWeights {
  at::Tensor input_norm, qkv_q4, qkv_bias, q_norm, k_norm, o_proj_q4, post_norm, gate_up_q4, down_q4;
};

struct Q4LayerShape {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f, scale = 1.f;
};

// Buffers of a step, reused from layer to layer; sized by the caller (reserve, below) outside the AVX-512 build.
struct Q4LayerScratch {
  std::vector<float> normed, qkv, q, attended, projected, gate_up, activated;
  std::vector<uint8_t> products;

  // Room for T rows of `shape` (products: the 4-bit kernel's q4_scratch_bytes, 9 bytes an input at most).
  void reserve(int64_t T, const Q4LayerShape& s) {
    const int64_t qw = s.heads * s.head_dim, qkv_n = qw + 2 * s.kv_heads * s.head_dim;
    auto grow = [](auto& buffer, int64_t n) {
      if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
    };
    grow(normed, T * std::max(s.hidden, qkv_n));
    grow(qkv, T * qkv_n);
    grow(q, T * qw);
    grow(attended, T * qw);
    grow(projected, T * s.hidden);
    grow(gate_up, T * 2 * s.intermediate);
    grow(activated, T * s.intermediate);
    grow(products, T * std::max({s.hidden, qw, s.intermediate}) * 2);
  }
};

// Whether the step runs on this shape (every width a multiple of 16).
bool q4_layer_supported(const Q4LayerShape& shape);

// x [T, hidden] (float32, contiguous), the residual stream, advanced through one layer: RMSNorm, the QKV product
// (+ bias), per-head q/k RMSNorm where the layer has it, rotary embedding with `cos`/`sin` [T, head_dim] (the
// sign folded into the first half of sin), the new K/V stored at `slots` of the layer's float32 caches
// [slots, kv_heads, head_dim], paged attention over `views`, the output product added, RMSNorm, gate/up,
// SiLU(gate) * up and the down product added. `scratch` holds room for T rows (Q4LayerScratch::reserve).
void q4_decode_layer(float* x, int64_t T, const Q4LayerWeights& w, const Q4LayerShape& shape, const float* cos,
                     const float* sin, const int64_t* slots, at::Tensor& k_cache, at::Tensor& v_cache,
                     const std::vector<AttentionChunk>& views, Q4LayerScratch& scratch);

}  // namespace pocket
