// Gated DeltaNet: Qwen3.5's linear-attention token mixer in float32 (CPU loops over raw memory, or ATen operations
// on any device). Per sequence it keeps a conv state (the last K-1 inputs of the depthwise causal conv) and a
// recurrent state S [value heads, key dim, value dim] in a numbered state slot; a chunk starting at position 0
// starts from zeros, whatever its slot held before.
//
// Per token t and value head (q and k L2-normalised per head, q also scaled by key_dim^-0.5):
//   S = exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
// with beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias). The output is RMS-normalised per head, scaled
// by the norm weight and by silu(z), then projected back to the hidden size.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "safetensors.h"

namespace pocket {

struct GatedDeltaShape {
  int64_t num_k_heads = 0, num_v_heads = 0, k_head_dim = 0, v_head_dim = 0, conv_kernel = 0;
  int64_t key_dim() const { return num_k_heads * k_head_dim; }
  int64_t value_dim() const { return num_v_heads * v_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// One sequence's rows [row0, row0 + n) of a forward, its state slot, and whether it starts the sequence.
struct DeltaChunk {
  int64_t row0 = 0, n = 0, slot = 0;
  bool fresh = false;
};

class GatedDeltaNet {
 public:
  // Takes the layer's tensors (`prefix` + in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, norm, out_proj) from weights.
  GatedDeltaNet(TensorMap& weights, const std::string& prefix, const GatedDeltaShape& shape, int64_t hidden,
                double eps);

  // Move the weights (and any states) to `device`; with `aten_ops` (required off the CPU) forward runs as ATen
  // operations instead of the CPU loops.
  void place(const at::Device& device, bool aten_ops);
  // Grow the per-slot states to hold slots [0, n).
  void ensure_slots(int64_t n);
  // Slot `to`'s conv and recurrent state set to slot `from`'s.
  void copy_slot(int64_t from, int64_t to);
  // h [T, hidden] (the normed input of every chunk's rows) -> the mixer's output [T, hidden]; states updated.
  at::Tensor forward(const at::Tensor& h, const std::vector<DeltaChunk>& chunks);

 private:
  // The conv over one chunk's rows of `mixed` (row stride `stride`), then SiLU, into act [n, conv_dim], with q and
  // k L2-normalised per key head (q also scaled); the slot's conv state advanced.
  void conv_chunk(const float* mixed, int64_t stride, const DeltaChunk& ch, float* act);

  // forward as ATen operations: per chunk the conv over its window, then the rule token by token.
  at::Tensor forward_aten(const at::Tensor& h, const std::vector<DeltaChunk>& chunks);
  void check_slot(const DeltaChunk& ch) const;

  GatedDeltaShape shape_;
  at::TensorOptions options_ = at::TensorOptions().dtype(at::kFloat);
  bool aten_ops_ = false;
  double eps_;
  at::Tensor in_proj_;     // [conv_dim + value_dim + 2 * Hv, hidden]: qkv, z, b, a
  at::Tensor conv_w_;      // [K, conv_dim]
  at::Tensor neg_a_, dt_bias_, norm_w_, out_proj_;
  std::vector<at::Tensor> conv_state_, ssm_state_;   // per slot: [K-1, conv_dim], [Hv, Dk, Dv]
};

}  // namespace pocket
