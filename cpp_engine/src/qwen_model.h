// A Qwen3 or Qwen3.5 (dense or MoE) decoder in float32, on the CPU or (a CUDA build) a CUDA device: weights loaded
// from safetensors, one forward over a flat batch of token chunks whose keys and values live in a paged KV cache.
// Llama and Qwen2 (read from GGUF: gguf_checkpoint.h) are the same decoder without the per-head q/k norms.
// Qwen3.5's Gated DeltaNet layers (gated_delta.h) keep a conv and a recurrent state per sequence in numbered state
// slots instead.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gated_delta.h"
#include "paged_attention.h"
#include "q4_decode_layer.h"
#include "safetensors.h"

namespace pocket {

struct QwenConfig {
  std::string architecture;
  std::string model_type;
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool tie_word_embeddings = false, attention_bias = false;
  bool qk_norm = true;                  // per-head q/k RMSNorm (Qwen3's; a GGUF's Llama and Qwen2 have none)
  std::vector<int64_t> eos_token_ids;   // config.json's, or a GGUF's eos/eot/eom ids (generation_config.json's
                                        // are read by the engine)
  // Qwen3-MoE: routed experts in the layers that are not dense (mlp_only_layers, decoder_sparse_step).
  int64_t num_experts = 0, experts_per_token = 0, moe_intermediate_size = 0, decoder_sparse_step = 1;
  bool norm_topk_prob = true;
  std::vector<int64_t> mlp_only_layers;
  // Qwen3.5 (qwen3_5_text, qwen3_5_moe_text): hybrid layers, (1 + w) norms, gated attention, partial rotary.
  bool hybrid = false;
  std::vector<char> linear_layers;        // per layer: 1 for a Gated DeltaNet (linear_attention) layer
  GatedDeltaShape delta;                  // the linear-attention layers' sizes
  double partial_rotary_factor = 1.0;
  int64_t shared_expert_intermediate_size = 0;
  bool is_moe_layer(int64_t layer) const;
  bool is_linear_layer(int64_t layer) const { return hybrid && linear_layers[layer]; }
  int64_t num_attention_layers() const;
  int64_t rotary_dim() const;
};

// Reads config.json of `directory`; throws std::invalid_argument for a model or feature this engine lacks.
QwenConfig read_qwen_config(const std::string& directory);

// One chunk of one sequence in a forward: tokens at positions [start, start + n) of a sequence whose KV slots
// for positions [0, start + n) are given by its block table.
struct Chunk {
  int64_t start = 0;
  int64_t num_tokens = 0;
  const std::vector<int64_t>* block_table = nullptr;
  bool wants_logits = false;   // the last token's logits are returned
  bool all_logits = false;     // every token's logits are returned (a speculative verify chunk)
  int64_t state_slot = -1;     // hybrid models: the sequence's recurrent-state slot (start 0: reset to zeros)
};

class QwenModel {
 public:
  QwenModel(const std::string& directory, const QwenConfig& config);   // its safetensors files
  QwenModel(TensorMap weights, const QwenConfig& config);              // HF-named float32 tensors

  const QwenConfig& config() const { return config_; }
  int64_t num_parameters() const { return num_parameters_; }
  int64_t decode_weight_bytes() const { return decode_weight_bytes_; }

  // Also hold the dense layers' linear weights (QKV, o_proj, gate/up, down) whose shapes fit as the 4-bit
  // kernel's records (q4_weights.h), which decode steps of up to 8 sequences multiply by; prompts keep the float32
  // weights, as do the embeddings. Only for weights that were 4-bit blocks (GGUF Q4_1), where the records hold them
  // exactly. The LM head gets records too (quantised from its float32 rows, so not exact): a decode step ranks the
  // vocabulary with them and recomputes the kRescored highest logits from the float32 rows, which keeps the float32
  // head's argmax whenever its best token is among them (logits outside stay 4-bit). Returns the layer matrices
  // converted.
  int64_t use_q4_weights();
  bool q4_weights() const { return q4_layers_ > 0; }

  // Move the weights to `device` ("cpu", "cuda" or "cuda:N"; before allocate_cache). With `aten_ops`, or on any
  // device but the CPU, attention and the Gated DeltaNet run as ATen operations (paged_attention_aten,
  // GatedDeltaNet's ATen form) instead of the CPU loops over raw memory. Throws std::invalid_argument for a device
  // this build cannot use, or 4-bit records off the CPU.
  void place(const std::string& device, bool aten_ops);
  const at::Device& device() const { return device_; }

  // Allocate the paged KV cache: num_blocks blocks of block_size positions, per (full-attention) layer.
  void allocate_cache(int64_t num_blocks, int64_t block_size);
  int64_t block_size() const { return block_size_; }

  // Hybrid models: a free recurrent-state slot (grown on demand), and its return.
  int64_t acquire_state_slot();
  void release_state_slot(int64_t slot);
  void copy_state_slot(int64_t from, int64_t to);   // every linear-attention layer's conv and recurrent state

  // Run `tokens` (every chunk's tokens, in chunk order) through the model, writing their K/V into the cache;
  // returns the logits [rows, vocab] of each chunk's last token where it wants logits, or of all its tokens where
  // it wants them all, in chunk order (on the CPU, wherever the model runs).
  at::Tensor forward(const std::vector<int64_t>& tokens, const std::vector<Chunk>& chunks);

 private:
  struct Layer {
    at::Tensor input_norm, qkv, qkv_bias, o_proj, q_norm, k_norm, post_norm, gate_up, down;
    at::Tensor qkv_q4, o_proj_q4, gate_up_q4, down_q4;   // use_q4_weights: the records (beside the float32 ones)
    at::Tensor router;                               // MoE: [experts, hidden]
    std::vector<at::Tensor> expert_gate_up, expert_down;
    at::Tensor shared_gate_up, shared_down, shared_gate;   // Qwen3.5-MoE's shared expert and its sigmoid gate
    std::unique_ptr<GatedDeltaNet> delta;            // Qwen3.5 linear-attention layers (no qkv/o_proj then)
  };
  at::Tensor moe(const Layer& l, const at::Tensor& h) const;
  // x @ W.T (+ bias) with W float32 (`weight`), or with the 4-bit records (`records`) where `q4` and they exist.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& records, bool q4,
                    const at::Tensor& bias = at::Tensor());
  at::Tensor attention(size_t li, const at::Tensor& h, const at::Tensor& slot, const at::Tensor& cos,
                       const at::Tensor& sin, const std::vector<AttentionChunk>& views,
                       const at::Tensor& context_slots, bool q4);
  at::TensorOptions options() const { return at::TensorOptions().dtype(at::kFloat).device(device_); }
  QwenConfig config_;
  at::Device device_ = at::kCPU;
  bool aten_ops_ = false;
  at::Tensor embed_, final_norm_, lm_head_, inv_freq_;
  at::Tensor lm_head_q4_;   // use_q4_weights: the LM head's records (beside the float32 rows, which rescore)
  // The float32 LM head applied to the final-normed rows `h` (decode rows with `q4`: ranked by the records, the
  // highest kRescored logits of each row recomputed exactly).
  at::Tensor logits(const at::Tensor& h, bool q4);
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_cache_, v_cache_;   // [blocks * block_size, kv_heads, head_dim] per layer
  int64_t block_size_ = 0;
  int64_t num_parameters_ = 0, decode_weight_bytes_ = 0;
  int64_t num_state_slots_ = 0;
  int64_t q4_layers_ = 0;
  std::vector<uint8_t> q4_scratch_;   // the 4-bit product's quantised activations
  // use_q4_weights: per layer, its weights for q4_decode_layer where a decode step runs the layer there (dense
  // layers of a model that is not hybrid, every product in records; else no records in it).
  std::vector<Q4LayerWeights> q4_layers_fused_;
  Q4LayerShape q4_shape_;
  bool q4_fused_any_ = false;
  Q4LayerScratch q4_layer_scratch_;
  std::vector<int64_t> free_state_slots_;
};

}  // namespace pocket
