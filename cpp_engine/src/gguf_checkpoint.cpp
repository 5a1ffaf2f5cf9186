// GGUF checkpoints (gguf_checkpoint.h). Names follow llama.cpp's converter: token_embd, output_norm, output
// (absent when tied to the embeddings) and per layer blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
// ffn_norm, ffn_gate, ffn_up, ffn_down}, Qwen3's attn_q_norm and attn_k_norm, Qwen2's q/k/v biases. The converter
// stores the llama architecture's q/k rows per head as interleaved pairs (for rotating adjacent channels); this
// engine rotates halves, so the rows are put back. qwen2 and qwen3 are stored unpermuted.
#include "gguf_checkpoint.h"

#include <map>
#include <stdexcept>

#include "gguf_dequant.h"

namespace pocket {
namespace {

// GGUF general.architecture -> the model this engine runs.
struct Architecture {
  const char* model_type;
  const char* hf_class;
  bool permuted_qk;   // llama.cpp's converter interleaved the q/k rows
  bool qk_norm;       // per-head RMSNorm of q and k (Qwen3)
};
const std::map<std::string, Architecture> kArchitectures = {
    {"llama", {"llama", "LlamaForCausalLM", true, false}},
    {"qwen2", {"qwen2", "Qwen2ForCausalLM", false, false}},
    {"qwen3", {"qwen3", "Qwen3ForCausalLM", false, true}},
};

const std::map<std::string, std::string> kGlobalNames = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
};
const std::map<std::string, std::string> kLayerNames = {
    {"attn_norm", "input_layernorm"},   {"ffn_norm", "post_attention_layernorm"},
    {"attn_q", "self_attn.q_proj"},     {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},     {"attn_output", "self_attn.o_proj"},
    {"ffn_gate", "mlp.gate_proj"},      {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},      {"attn_q_norm", "self_attn.q_norm"},
    {"attn_k_norm", "self_attn.k_norm"},
};

// A per-model integer GGUF may also store per layer (then every layer must agree).
int64_t uniform(const GgufFile& file, const std::string& key, int64_t fallback) {
  const GgufValue* v = file.find(key);
  if (!v) {
    if (fallback < 0) throw std::invalid_argument("GGUF metadata lacks '" + key + "'");
    return fallback;
  }
  if (v->kind == GgufValue::Kind::Array) {
    if (v->items.empty()) throw std::invalid_argument("GGUF metadata '" + key + "' is an empty list");
    for (const GgufValue& item : v->items)
      if (item.integer != v->items[0].integer)
        throw std::invalid_argument("GGUF metadata '" + key + "' varies per layer; not supported");
    return v->items[0].integer;
  }
  return file.integer(key);
}

// "blk.N.part.suffix" -> (N, part, suffix); false for another name.
bool split_layer_name(const std::string& name, std::string& layer, std::string& part, std::string& suffix) {
  if (name.rfind("blk.", 0) != 0) return false;
  const size_t a = name.find('.', 4);
  const size_t b = a == std::string::npos ? a : name.rfind('.');
  if (a == std::string::npos || b <= a) return false;
  layer = name.substr(4, a - 4);
  part = name.substr(a + 1, b - a - 1);
  suffix = name.substr(b + 1);
  return !layer.empty() && layer.find_first_not_of("0123456789") == std::string::npos;
}

// llama.cpp's q/k rows per head: pairs (2i, 2i + 1) interleaved; back to the halves (i, i + head_dim / 2).
at::Tensor unpermute_rope_rows(const at::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), half = rows / heads / 2;
  if (heads * 2 * half != rows)
    throw std::invalid_argument("q/k rows (" + std::to_string(rows) + ") are not a multiple of 2 x heads");
  std::vector<int64_t> grouped = {heads, half, 2};
  for (int64_t d = 1; d < w.dim(); ++d) grouped.push_back(w.size(d));
  return w.reshape(grouped).transpose(1, 2).reshape(w.sizes()).contiguous();
}

}  // namespace

QwenConfig read_gguf_config(const GgufFile& file) {
  const std::string arch = file.string_or("general.architecture", "");
  auto known = kArchitectures.find(arch);
  if (known == kArchitectures.end())
    throw std::invalid_argument("the native engine runs GGUF files of the llama, qwen2 and qwen3 architectures; "
                                "this one is '" + arch + "'");
  const GgufTensor* embed = file.tensor("token_embd.weight");
  if (!embed || embed->shape.size() != 2) throw std::invalid_argument("GGUF file has no token_embd.weight matrix");
  if (file.tensor("rope_freqs.weight") || file.find(arch + ".rope.scaling.type") ||
      file.find(arch + ".rope.scale_linear")) {
    const std::string kind = file.string_or(arch + ".rope.scaling.type", "llama3");
    if (kind != "none") throw std::invalid_argument("rope scaling (" + kind + ") is not implemented by the native engine");
  }
  QwenConfig c;
  c.architecture = known->second.hf_class;
  c.model_type = known->second.model_type;
  c.qk_norm = known->second.qk_norm;
  c.vocab_size = embed->shape[0];
  c.hidden_size = file.integer(arch + ".embedding_length");
  c.intermediate_size = uniform(file, arch + ".feed_forward_length", -1);
  c.num_layers = file.integer(arch + ".block_count");
  c.num_heads = uniform(file, arch + ".attention.head_count", -1);
  c.num_kv_heads = uniform(file, arch + ".attention.head_count_kv", c.num_heads);
  if (c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0)
    throw std::invalid_argument("GGUF head counts: the heads must be a multiple of the KV heads");
  c.head_dim = file.integer_or(arch + ".attention.key_length",
                               file.integer_or(arch + ".rope.dimension_count", c.hidden_size / c.num_heads));
  c.max_position_embeddings = file.integer_or(arch + ".context_length", 4096);
  c.rms_norm_eps = file.number_or(arch + ".attention.layer_norm_rms_epsilon", 1e-6);
  c.rope_theta = file.number_or(arch + ".rope.freq_base", 10000.0);
  c.tie_word_embeddings = file.tensor("output.weight") == nullptr;
  c.attention_bias = file.tensor("blk.0.attn_q.bias") != nullptr;
  if (c.head_dim % 2 != 0) throw std::invalid_argument("GGUF head size must be even for the rotary embedding");
  // Every end-of-generation id llama.cpp stops on (eos, eot, eom), as the Python engine reads them.
  for (const char* kind : {"eos", "eot", "eom"}) {
    const int64_t id = file.integer_or(std::string("tokenizer.ggml.") + kind + "_token_id", -1);
    bool seen = false;
    for (int64_t e : c.eos_token_ids) seen = seen || e == id;
    if (id >= 0 && !seen) c.eos_token_ids.push_back(id);
  }
  return c;
}

TensorMap load_gguf_weights(const GgufFile& file, const QwenConfig& config) {
  TensorMap out;
  for (const GgufTensor& t : file.tensors()) {
    std::string name, layer, part, suffix;
    if (auto it = kGlobalNames.find(t.name); it != kGlobalNames.end()) {
      name = it->second;
    } else if (split_layer_name(t.name, layer, part, suffix) && kLayerNames.count(part) &&
               (suffix == "weight" || suffix == "bias")) {
      name = "model.layers." + layer + "." + kLayerNames.at(part) + "." + suffix;
    } else {
      throw std::invalid_argument("GGUF tensor " + t.name + " has no name the native engine knows");
    }
    at::Tensor w = dequantize(t);
    const bool permuted = kArchitectures.at(config.model_type).permuted_qk;   // model_type == the GGUF name
    if (permuted && part == "attn_q") w = unpermute_rope_rows(w, config.num_heads);
    else if (permuted && part == "attn_k") w = unpermute_rope_rows(w, config.num_kv_heads);
    out[name] = w;
  }
  return out;
}

}  // namespace pocket
