// A Qwen3 (dense or MoE) decoder on CPU in float32: weights loaded from safetensors, one forward over a flat batch of
// token chunks whose keys and values live in a paged KV cache.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pocket {

struct QwenConfig {
  std::string architecture;
  std::string model_type;
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool tie_word_embeddings = false, attention_bias = false;
  std::vector<int64_t> eos_token_ids;   // config.json's (generation_config.json's are read by the engine)
  // Qwen3-MoE: routed experts in the layers that are not dense (mlp_only_layers, decoder_sparse_step).
  int64_t num_experts = 0, experts_per_token = 0, moe_intermediate_size = 0, decoder_sparse_step = 1;
  bool norm_topk_prob = true;
  std::vector<int64_t> mlp_only_layers;
  bool is_moe_layer(int64_t layer) const;
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
};

class QwenModel {
 public:
  QwenModel(const std::string& directory, const QwenConfig& config);

  const QwenConfig& config() const { return config_; }
  int64_t num_parameters() const { return num_parameters_; }
  int64_t decode_weight_bytes() const { return decode_weight_bytes_; }

  // Allocate the paged KV cache: num_blocks blocks of block_size positions, per layer.
  void allocate_cache(int64_t num_blocks, int64_t block_size);
  int64_t block_size() const { return block_size_; }

  // Run `tokens` (every chunk's tokens, in chunk order) through the model, writing their K/V into the cache;
  // returns the logits [chunks wanting logits, vocab] of each such chunk's last token, in chunk order.
  at::Tensor forward(const std::vector<int64_t>& tokens, const std::vector<Chunk>& chunks);

 private:
  struct Layer {
    at::Tensor input_norm, qkv, qkv_bias, o_proj, q_norm, k_norm, post_norm, gate_up, down;
    at::Tensor router;                               // MoE: [experts, hidden]
    std::vector<at::Tensor> expert_gate_up, expert_down;
  };
  at::Tensor moe(const Layer& l, const at::Tensor& h) const;
  QwenConfig config_;
  at::Tensor embed_, final_norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_cache_, v_cache_;   // [blocks * block_size, kv_heads, head_dim] per layer
  int64_t block_size_ = 0;
  int64_t num_parameters_ = 0, decode_weight_bytes_ = 0;
};

}  // namespace pocket
