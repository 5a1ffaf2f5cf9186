// The Qwen3 forward (qwen_model.h): RMSNorm, fused QKV with per-head q/k norms, rotary embedding (halves
// rotated), paged causal attention with grouped KV heads, SwiGLU MLP, and the (possibly tied) LM head.
// Qwen3.5 adds: RMSNorm weights stored around zero (scaling by 1 + w, folded in at load), Gated DeltaNet layers
// (gated_delta.h) between the full-attention ones, a sigmoid output gate read from q_proj (per head: the query's
// head_dim rows, then the gate's), rotary on the first partial_rotary_factor of each head, and for the MoE a
// shared expert scaled by sigmoid(shared_expert_gate).
#include "qwen_model.h"

#include <omp.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "json.h"
#include "paged_attention.h"
#include "q4_weights.h"
#include "safetensors.h"

namespace pocket {
namespace {

constexpr int64_t kRescored = 64;   // 4-bit LM head: logits recomputed from the float32 rows, as RescoredLMHead
constexpr int64_t kQ4Rows = 8;   // most rows of a 4-bit product (more: the float32 weights), as INT4_MAX_ROWS

// libtorch's parallel_for (OpenMP) on the calling thread alone while it lives.
class SerialRegion {
 public:
  SerialRegion() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SerialRegion() { omp_set_num_threads(before_); }
  SerialRegion(const SerialRegion&) = delete;
  SerialRegion& operator=(const SerialRegion&) = delete;

 private:
  int before_;
};

Json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot read " + path);
  std::stringstream buf;
  buf << in.rdbuf();
  return Json::parse(buf.str());
}

int64_t int_of(const Json& cfg, const char* key) {
  const Json* v = cfg.find(key);
  if (!v || !v->is_number()) throw std::invalid_argument(std::string("config.json has no integer '") + key + "'");
  return v->as_int();
}

at::Tensor take(TensorMap& weights, const std::string& name) {
  auto it = weights.find(name);
  if (it == weights.end()) throw std::invalid_argument("checkpoint has no tensor " + name);
  at::Tensor t = it->second;
  weights.erase(it);
  return t;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor var = x.pow(2).mean(-1, true);
  return x * at::rsqrt(var + eps) * weight;
}

// Rotate the halves of the first 2 * cos.size(-1) channels of the last dimension by the angles of `cos`/`sin`
// ([T, 1, R/2]); the other channels pass unchanged (partial rotary).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = cos.size(-1), rotary = 2 * half;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  if (rotary == x.size(-1)) return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin, x.narrow(-1, rotary, x.size(-1) - rotary)}, -1);
}

bool bool_of(const Json& cfg, const char* key, bool fallback) {
  const Json* v = cfg.find(key);
  return v && v->type == Json::Type::Bool ? v->boolean : fallback;
}

// Qwen3.5's per-layer mixers: layer_types, else every full_attention_interval-th layer is full attention.
void read_hybrid_layers(const Json& cfg, QwenConfig& c) {
  c.hybrid = true;
  c.linear_layers.assign(static_cast<size_t>(c.num_layers), 0);
  if (const Json* types = cfg.find("layer_types"); types && types->is_array()) {
    if (static_cast<int64_t>(types->array.size()) != c.num_layers)
      throw std::invalid_argument("config.json: layer_types does not name every layer");
    for (size_t i = 0; i < types->array.size(); ++i) {
      const std::string& t = types->array[i].as_string();
      if (t != "linear_attention" && t != "full_attention")
        throw std::invalid_argument("layer type '" + t + "' is not implemented by the native engine");
      c.linear_layers[i] = t == "linear_attention";
    }
  } else {
    const Json* v = cfg.find("full_attention_interval");
    const int64_t interval = v && v->is_number() ? v->as_int() : 4;
    if (interval < 1) throw std::invalid_argument("config.json: full_attention_interval must be >= 1");
    for (int64_t i = 0; i < c.num_layers; ++i) c.linear_layers[i] = (i + 1) % interval != 0;
  }
  c.delta.num_k_heads = int_of(cfg, "linear_num_key_heads");
  c.delta.num_v_heads = int_of(cfg, "linear_num_value_heads");
  c.delta.k_head_dim = int_of(cfg, "linear_key_head_dim");
  c.delta.v_head_dim = int_of(cfg, "linear_value_head_dim");
  c.delta.conv_kernel = int_of(cfg, "linear_conv_kernel_dim");
}

// Checkpoint names as this engine reads them: a multimodal checkpoint's text model (model.language_model.*) as
// model.*; the vision tower and the multi-token-prediction head dropped.
TensorMap text_weights(TensorMap loaded) {
  TensorMap out;
  const std::string lm = "model.language_model.";
  for (auto& [name, t] : loaded) {
    if (name.rfind("mtp.", 0) == 0 || name.rfind("model.visual.", 0) == 0 || name.rfind("visual.", 0) == 0) continue;
    if (name.rfind(lm, 0) == 0) out["model." + name.substr(lm.size())] = t;
    else out[name] = t;
  }
  return out;
}

}  // namespace

QwenConfig read_qwen_config(const std::string& directory) {
  const Json outer = read_json(directory + "/config.json");
  // A multimodal checkpoint's text model: its text_config (copied out of `outer`, never assigned over itself).
  const Json* text = outer.find("text_config");
  const Json cfg = text && text->is_object() ? Json(*text) : outer;
  QwenConfig c;
  c.model_type = cfg.has("model_type") ? cfg.at("model_type").as_string() : "";
  const Json* archs = cfg.find("architectures");
  if (!archs || !archs->is_array() || archs->array.empty()) archs = outer.find("architectures");
  c.architecture = archs && archs->is_array() && !archs->array.empty() ? archs->array[0].as_string() : "";
  const bool qwen3_5 = c.model_type == "qwen3_5_text" || c.model_type == "qwen3_5_moe_text";
  if (c.model_type != "qwen3" && c.model_type != "qwen3_moe" && !qwen3_5)
    throw std::invalid_argument("the native engine runs Qwen3, Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE checkpoints "
                                "(model_type 'qwen3', 'qwen3_moe', 'qwen3_5_text', 'qwen3_5_moe_text'); this one is '" +
                                c.model_type + "'");
  if (c.model_type == "qwen3_5_moe_text") {   // every layer: routed experts (renormalised top-k) + shared expert
    c.num_experts = int_of(cfg, "num_experts");
    c.experts_per_token = int_of(cfg, "num_experts_per_tok");
    c.moe_intermediate_size = int_of(cfg, "moe_intermediate_size");
    c.shared_expert_intermediate_size = int_of(cfg, "shared_expert_intermediate_size");
    if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts)
      throw std::invalid_argument("config.json: bad expert counts");
  }
  if (c.model_type == "qwen3_moe") {
    const Json* experts = cfg.find("num_experts");
    if (!experts || !experts->is_number()) experts = cfg.find("num_local_experts");
    if (!experts || !experts->is_number()) throw std::invalid_argument("config.json names no number of experts");
    c.num_experts = experts->as_int();
    c.experts_per_token = int_of(cfg, "num_experts_per_tok");
    c.moe_intermediate_size = int_of(cfg, "moe_intermediate_size");
    if (const Json* v = cfg.find("decoder_sparse_step"); v && v->is_number()) c.decoder_sparse_step = v->as_int();
    if (const Json* v = cfg.find("norm_topk_prob"); v && v->type == Json::Type::Bool) c.norm_topk_prob = v->boolean;
    if (const Json* v = cfg.find("mlp_only_layers"); v && v->is_array())
      for (const Json& e : v->array) c.mlp_only_layers.push_back(e.as_int());
    if (c.experts_per_token < 1 || c.experts_per_token > c.num_experts || c.decoder_sparse_step < 1)
      throw std::invalid_argument("config.json: bad expert counts or decoder_sparse_step");
  }
  c.vocab_size = int_of(cfg, "vocab_size");
  c.hidden_size = int_of(cfg, "hidden_size");
  c.intermediate_size = c.model_type == "qwen3_5_moe_text" && !cfg.has("intermediate_size")
                            ? 0 : int_of(cfg, "intermediate_size");
  c.num_layers = int_of(cfg, "num_hidden_layers");
  c.num_heads = int_of(cfg, "num_attention_heads");
  c.num_kv_heads = cfg.has("num_key_value_heads") ? int_of(cfg, "num_key_value_heads") : c.num_heads;
  const Json* hd = cfg.find("head_dim");
  c.head_dim = hd && hd->is_number() ? hd->as_int() : c.hidden_size / c.num_heads;
  c.max_position_embeddings = cfg.has("max_position_embeddings") ? int_of(cfg, "max_position_embeddings") : 32768;
  if (const Json* v = cfg.find("rms_norm_eps"); v && v->is_number()) c.rms_norm_eps = v->as_double();
  c.tie_word_embeddings = bool_of(cfg, "tie_word_embeddings", bool_of(outer, "tie_word_embeddings", false));
  c.attention_bias = bool_of(cfg, "attention_bias", false);
  if (qwen3_5) read_hybrid_layers(cfg, c);
  const Json* rope_params = cfg.find("rope_parameters");
  if (!rope_params || rope_params->is_null()) rope_params = cfg.find("rope_scaling");
  if (const Json* v = cfg.find("rope_theta"); v && v->is_number()) c.rope_theta = v->as_double();
  if (rope_params && rope_params->is_object()) {
    if (const Json* v = rope_params->find("rope_theta"); v && v->is_number()) c.rope_theta = v->as_double();
    // Qwen3.5's multimodal rotary sections are degenerate for text (all position streams are the token's).
    if (const Json* v = rope_params->find("partial_rotary_factor"); v && v->is_number())
      c.partial_rotary_factor = v->as_double();
    const Json* type = rope_params->find("rope_type");
    if (!type) type = rope_params->find("type");
    if (type && type->is_string() && type->as_string() != "default")
      throw std::invalid_argument("rope type '" + type->as_string() + "' is not implemented by the native engine");
  }
  if (const Json* v = cfg.find("use_sliding_window"); v && v->type == Json::Type::Bool && v->boolean)
    throw std::invalid_argument("sliding-window attention is not implemented by the native engine");
  if (qwen3_5 && !(rope_params && rope_params->is_object() && rope_params->has("partial_rotary_factor")))
    if (const Json* v = cfg.find("partial_rotary_factor"); v && v->is_number()) c.partial_rotary_factor = v->as_double();
  if (c.rotary_dim() % 2 != 0 || c.rotary_dim() < 2 || c.rotary_dim() > c.head_dim ||
      c.num_heads % c.num_kv_heads != 0)
    throw std::invalid_argument("config.json: the rotary width must be even and the heads a multiple of the KV heads");
  const Json* eos = cfg.find("eos_token_id");
  if (!eos || eos->is_null()) eos = outer.find("eos_token_id");
  if (const Json* v = eos) {
    if (v->is_number()) c.eos_token_ids.push_back(v->as_int());
    for (const Json& e : v->array) c.eos_token_ids.push_back(e.as_int());
  }
  return c;
}

int64_t QwenConfig::rotary_dim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }

int64_t QwenConfig::num_attention_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_layers; ++i) n += !is_linear_layer(i);
  return n;
}

bool QwenConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  for (int64_t dense : mlp_only_layers)
    if (dense == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

QwenModel::QwenModel(const std::string& directory, const QwenConfig& config)
    : QwenModel(text_weights(load_safetensors_dir(directory)), config) {}

QwenModel::QwenModel(TensorMap w, const QwenConfig& config) : config_(config) {
  // Qwen3.5's RMSNorm weights (not its DeltaNet's gated norm) are stored around zero: the scale is 1 + w.
  auto offset = [this](const at::Tensor& weight) { return config_.hybrid ? weight + 1.0 : weight; };
  for (const auto& [name, t] : w) {
    num_parameters_ += t.numel();
    if (name == "model.embed_tokens.weight" && !config_.tie_word_embeddings) continue;   // one row per token
    const bool routed = name.find(".mlp.experts.") != std::string::npos;   // top-k of the experts per token
    decode_weight_bytes_ += routed ? t.numel() * 4 * config_.experts_per_token / config_.num_experts : t.numel() * 4;
  }
  embed_ = take(w, "model.embed_tokens.weight");
  if (embed_.size(0) != config_.vocab_size || embed_.size(1) != config_.hidden_size)
    throw std::invalid_argument("model.embed_tokens.weight does not match config.json's sizes");
  final_norm_ = offset(take(w, "model.norm.weight"));
  auto head = w.find("lm_head.weight");
  if (head != w.end()) { lm_head_ = head->second; w.erase(head); }
  else if (config_.tie_word_embeddings) lm_head_ = embed_;
  else throw std::invalid_argument("checkpoint has no lm_head.weight and does not tie it to the embeddings");
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = offset(take(w, p + "input_layernorm.weight"));
    l.post_norm = offset(take(w, p + "post_attention_layernorm.weight"));
    if (config_.is_linear_layer(i)) {
      l.delta = std::make_unique<GatedDeltaNet>(w, p + "linear_attn.", config_.delta, config_.hidden_size,
                                                config_.rms_norm_eps);
    } else {
      // Qwen3.5's q_proj holds, per head, the query's head_dim rows then its output gate's.
      const int64_t q_rows = config_.num_heads * config_.head_dim * (config_.hybrid ? 2 : 1);
      at::Tensor q = take(w, p + "self_attn.q_proj.weight"), k = take(w, p + "self_attn.k_proj.weight"),
                 v = take(w, p + "self_attn.v_proj.weight");
      if (q.size(0) != q_rows || k.size(0) != config_.num_kv_heads * config_.head_dim)
        throw std::invalid_argument("attention projections of layer " + std::to_string(i) + " do not match config.json");
      l.qkv = at::cat({q, k, v}, 0).contiguous();
      if (w.count(p + "self_attn.q_proj.bias"))
        l.qkv_bias = at::cat({take(w, p + "self_attn.q_proj.bias"), take(w, p + "self_attn.k_proj.bias"),
                              take(w, p + "self_attn.v_proj.bias")}, 0);
      l.o_proj = take(w, p + "self_attn.o_proj.weight");
      if (config_.qk_norm) {
        l.q_norm = offset(take(w, p + "self_attn.q_norm.weight"));
        l.k_norm = offset(take(w, p + "self_attn.k_norm.weight"));
      }
    }
    if (config_.is_moe_layer(i)) {
      l.router = take(w, p + "mlp.gate.weight");
      if (w.count(p + "mlp.experts.gate_up_proj")) {   // stacked: [experts, 2 * I, hidden] and [experts, hidden, I]
        at::Tensor gate_up = take(w, p + "mlp.experts.gate_up_proj"), down = take(w, p + "mlp.experts.down_proj");
        if (gate_up.size(0) != config_.num_experts || down.size(0) != config_.num_experts)
          throw std::invalid_argument("stacked experts of layer " + std::to_string(i) + " do not match config.json");
        for (int64_t e = 0; e < config_.num_experts; ++e) {
          l.expert_gate_up.push_back(gate_up.select(0, e).contiguous());
          l.expert_down.push_back(down.select(0, e).contiguous());
        }
      } else {
        for (int64_t e = 0; e < config_.num_experts; ++e) {
          const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
          l.expert_gate_up.push_back(
              at::cat({take(w, x + "gate_proj.weight"), take(w, x + "up_proj.weight")}, 0).contiguous());
          l.expert_down.push_back(take(w, x + "down_proj.weight"));
        }
      }
      if (config_.shared_expert_intermediate_size > 0) {
        const std::string x = p + "mlp.shared_expert.";
        l.shared_gate_up = at::cat({take(w, x + "gate_proj.weight"), take(w, x + "up_proj.weight")}, 0).contiguous();
        l.shared_down = take(w, x + "down_proj.weight");
        l.shared_gate = take(w, p + "mlp.shared_expert_gate.weight");
      }
    } else {
      l.gate_up = at::cat({take(w, p + "mlp.gate_proj.weight"), take(w, p + "mlp.up_proj.weight")}, 0).contiguous();
      l.down = take(w, p + "mlp.down_proj.weight");
    }
    layers_.push_back(std::move(l));
  }
  if (!w.empty())
    throw std::invalid_argument("checkpoint tensor " + w.begin()->first + " is not used by the native engine");
  const int64_t rotary = config_.rotary_dim();
  inv_freq_ = 1.0 / at::pow(config_.rope_theta, at::arange(0, rotary, 2, at::kLong).to(at::kFloat) / rotary);
}

void QwenModel::place(const std::string& name, bool aten_ops) {
  at::Device device = at::kCPU;
  try {
    device = at::Device(name);
  } catch (const c10::Error&) {
    throw std::invalid_argument("device must be 'cpu', 'cuda' or 'cuda:N', not '" + name + "'");
  }
  if (device.is_cuda()) {
#ifndef POCKET_CUDA
    throw std::invalid_argument("device '" + name + "': this build of the native engine runs on the CPU only "
                                "(pocketllm_cpp.backend is 'cpu'; build it with -DPOCKET_BACKEND=cuda)");
#endif
    if (!at::hasCUDA()) throw std::invalid_argument("device '" + name + "': no CUDA device is available");
  } else if (!device.is_cpu()) {
    throw std::invalid_argument("device must be 'cpu', 'cuda' or 'cuda:N', not '" + name + "'");
  }
  if (!device.is_cpu() && q4_layers_ > 0)
    throw std::invalid_argument("4-bit records run on the CPU only: load the GGUF with weight_format 'float32'");
  device_ = device;
  aten_ops_ = aten_ops || !device.is_cpu();
  auto move = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(device);
  };
  const bool tied = lm_head_.is_same(embed_);
  for (at::Tensor* t : {&embed_, &final_norm_, &inv_freq_}) move(*t);
  if (tied) lm_head_ = embed_;
  else move(lm_head_);
  for (Layer& l : layers_) {
    for (at::Tensor* t : {&l.input_norm, &l.qkv, &l.qkv_bias, &l.o_proj, &l.q_norm, &l.k_norm, &l.post_norm,
                          &l.gate_up, &l.down, &l.router, &l.shared_gate_up, &l.shared_down, &l.shared_gate})
      move(*t);
    for (auto* experts : {&l.expert_gate_up, &l.expert_down})
      for (at::Tensor& t : *experts) move(t);
    if (l.delta) l.delta->place(device, aten_ops_);
  }
}

int64_t QwenModel::use_q4_weights() {
  if (!device_.is_cpu()) throw std::logic_error("4-bit records are for a model on the CPU");
  SerialRegion serial;   // small ATen ops per matrix at load: threads cost more than they give here
  int64_t converted = 0;
  auto convert = [&](at::Tensor& weight, at::Tensor& records) {
    if (!weight.defined() || !q4_shape_supported(weight.size(0), weight.size(1))) return;
    records = q4_pack(weight);
    decode_weight_bytes_ += records.numel() - weight.numel() * 4;   // a decode step reads the records
    ++converted;
  };
  for (Layer& l : layers_) {
    if (l.delta || l.router.defined()) continue;   // Qwen3.5 and MoE layers keep float32
    convert(l.qkv, l.qkv_q4);
    convert(l.o_proj, l.o_proj_q4);
    convert(l.gate_up, l.gate_up_q4);
    convert(l.down, l.down_q4);
  }
  q4_layers_ += converted;
  const QwenConfig& c = config_;
  q4_shape_ = Q4LayerShape{c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                           static_cast<float>(c.rms_norm_eps), static_cast<float>(1.0 / std::sqrt(double(c.head_dim)))};
  q4_layers_fused_.assign(layers_.size(), Q4LayerWeights{});
  if (!c.hybrid && c.rotary_dim() == c.head_dim && q4_layer_supported(q4_shape_)) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (l.router.defined() || !l.qkv_q4.defined() || !l.o_proj_q4.defined() || !l.gate_up_q4.defined() ||
          !l.down_q4.defined())
        continue;
      q4_layers_fused_[i] = Q4LayerWeights{l.input_norm, l.qkv_q4, l.qkv_bias, l.q_norm, l.k_norm,
                                           l.o_proj_q4, l.post_norm, l.gate_up_q4, l.down_q4};
      q4_fused_any_ = true;
    }
  }
  if (converted > 0 && q4_shape_supported(lm_head_.size(0), lm_head_.size(1))) {
    lm_head_q4_ = q4_pack(lm_head_);
    decode_weight_bytes_ += lm_head_q4_.numel() - lm_head_.numel() * 4;
  }
  return converted;
}

at::Tensor QwenModel::logits(const at::Tensor& h, bool q4) {
  if (!q4 || !lm_head_q4_.defined()) return at::linear(h, lm_head_);
  at::Tensor out = q4_linear(h, lm_head_q4_, at::Tensor(), q4_scratch_);
  rescore_top(out, h, lm_head_, std::min<int64_t>(kRescored, out.size(1)));
  return out;
}

at::Tensor QwenModel::linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& records, bool q4,
                             const at::Tensor& bias) {
  if (records.defined() && q4) {
    // Over libtorch's intra-op threads (the engine's num_threads), as the Torch plane's int4 layers: on the quiet
    // 2-core VM the default model decodes ~20% faster than on the calling thread alone. Each product is one
    // OpenMP region, so where the other cores are busy every region waits for a time slice (2.2-3.7 tok/s
    // against about 60): num_threads 1 is the setting for such a machine.
    return q4_linear(x, records, bias, q4_scratch_);
  }
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

int64_t QwenModel::acquire_state_slot() {
  if (!free_state_slots_.empty()) {
    const int64_t slot = free_state_slots_.back();
    free_state_slots_.pop_back();
    return slot;
  }
  const int64_t slot = num_state_slots_++;
  for (Layer& l : layers_)
    if (l.delta) l.delta->ensure_slots(num_state_slots_);
  return slot;
}

void QwenModel::release_state_slot(int64_t slot) {
  if (slot >= 0) free_state_slots_.push_back(slot);
}

void QwenModel::copy_state_slot(int64_t from, int64_t to) {
  for (Layer& l : layers_)
    if (l.delta) l.delta->copy_slot(from, to);
}

// Each token's top-k experts by router softmax (renormalised when norm_topk_prob), their SwiGLU outputs summed
// with those weights; every expert runs once over the rows routed to it.
at::Tensor QwenModel::moe(const Layer& l, const at::Tensor& h) const {
  const QwenConfig& c = config_;
  at::Tensor probs = at::softmax(at::linear(h, l.router), -1);
  auto [weights, experts] = at::topk(probs, c.experts_per_token, -1);
  if (c.norm_topk_prob) weights = weights / weights.sum(-1, true);
  at::Tensor out = at::zeros_like(h);
  const int64_t T = h.size(0), K = c.experts_per_token, I = c.moe_intermediate_size;
  const at::Tensor host_ids = experts.cpu();   // the routing, read on the host
  const int64_t* ids = host_ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(c.num_experts), slots(c.num_experts);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      rows[ids[t * K + k]].push_back(t);
      slots[ids[t * K + k]].push_back(t * K + k);
    }
  at::Tensor flat_weights = weights.reshape({-1});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (rows[e].empty()) continue;
    at::Tensor idx = at::tensor(rows[e], at::kLong).to(device_);
    at::Tensor gu = at::linear(h.index_select(0, idx), l.expert_gate_up[e]);
    at::Tensor y = at::linear(at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I), l.expert_down[e]);
    y = y * flat_weights.index_select(0, at::tensor(slots[e], at::kLong).to(device_)).unsqueeze(1);
    out.index_add_(0, idx, y);
  }
  if (l.shared_gate_up.defined()) {
    const int64_t S = c.shared_expert_intermediate_size;
    at::Tensor gu = at::linear(h, l.shared_gate_up);
    at::Tensor shared = at::linear(at::silu(gu.narrow(1, 0, S)) * gu.narrow(1, S, S), l.shared_down);
    out = out + at::sigmoid(at::linear(h, l.shared_gate)) * shared;
  }
  return out;
}

void QwenModel::allocate_cache(int64_t num_blocks, int64_t block_size) {
  block_size_ = block_size;
  k_cache_.clear();
  v_cache_.clear();
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    if (config_.is_linear_layer(i)) {   // linear-attention layers keep no KV
      k_cache_.emplace_back();
      v_cache_.emplace_back();
      continue;
    }
    // Pages are touched when a block is first written; a slot is read only after its position was written.
    k_cache_.push_back(at::empty({num_blocks * block_size, config_.num_kv_heads, config_.head_dim}, options()));
    v_cache_.push_back(at::empty({num_blocks * block_size, config_.num_kv_heads, config_.head_dim}, options()));
  }
}

// One full-attention layer over the normed input h [T, hidden]: K/V written to the cache slots `slot`, attention
// over each chunk's context, Qwen3.5's sigmoid output gate, the output projection.
at::Tensor QwenModel::attention(size_t li, const at::Tensor& h, const at::Tensor& slot, const at::Tensor& cos,
                                const at::Tensor& sin, const std::vector<AttentionChunk>& views,
                                const at::Tensor& context_slots, bool q4) {
  const QwenConfig& c = config_;
  const Layer& l = layers_[li];
  const int64_t T = h.size(0), H = c.num_heads, KVH = c.num_kv_heads, D = c.head_dim;
  const int64_t QW = c.hybrid ? 2 * H * D : H * D;   // Qwen3.5: per head the query, then its gate
  at::Tensor qkv = linear(h, l.qkv, l.qkv_q4, q4, l.qkv_bias);
  at::Tensor q, gate;
  if (c.hybrid) {
    at::Tensor query_gate = qkv.narrow(1, 0, QW).view({T, H, 2 * D});
    q = query_gate.narrow(2, 0, D);
    gate = query_gate.narrow(2, D, D);
  } else {
    q = qkv.narrow(1, 0, QW).view({T, H, D});
  }
  at::Tensor k = qkv.narrow(1, QW, KVH * D).view({T, KVH, D});
  at::Tensor v = qkv.narrow(1, QW + KVH * D, KVH * D).view({T, KVH, D});
  if (l.q_norm.defined()) {
    q = rms_norm(q, l.q_norm, c.rms_norm_eps);
    k = rms_norm(k, l.k_norm, c.rms_norm_eps);
  }
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  k_cache_[li].index_copy_(0, slot, k);
  v_cache_[li].index_copy_(0, slot, v);
  at::Tensor attn = at::empty({T, H, D}, options());
  q = q.contiguous();
  const float scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  if (aten_ops_) paged_attention_aten(q, k_cache_[li], v_cache_[li], attn, views, context_slots, scale);
  else paged_attention(q.data_ptr<float>(), k_cache_[li], v_cache_[li], attn.data_ptr<float>(), views, H, KVH, D, scale);
  if (gate.defined()) attn = attn * at::sigmoid(gate);
  return linear(attn.reshape({T, H * D}), l.o_proj, l.o_proj_q4, q4);
}

at::Tensor QwenModel::forward(const std::vector<int64_t>& tokens, const std::vector<Chunk>& chunks) {
  c10::InferenceMode inference;
  const QwenConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t bs = block_size_;
  // Positions and cache slots of the new tokens, and per chunk the slots of its whole context.
  std::vector<int64_t> positions, slots, logit_rows;
  std::vector<AttentionChunk> views(chunks.size());
  std::vector<DeltaChunk> delta_chunks(chunks.size());
  positions.reserve(T);
  slots.reserve(T);
  // Every chunk's context slots back to back (reserved whole first: the views point into it).
  std::vector<int64_t> contexts;
  size_t context_total = 0;
  for (const Chunk& ch : chunks) context_total += static_cast<size_t>(ch.start + ch.num_tokens);
  contexts.reserve(context_total);
  int64_t row = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const Chunk& ch = chunks[ci];
    const auto& table = *ch.block_table;
    const int64_t end = ch.start + ch.num_tokens;
    if (static_cast<int64_t>(table.size()) * bs < end) throw std::logic_error("block table too short for a chunk");
    const int64_t offset = static_cast<int64_t>(contexts.size());
    for (int64_t p = 0; p < end; ++p) contexts.push_back(table[p / bs] * bs + p % bs);
    const int64_t* ctx = contexts.data() + offset;
    for (int64_t p = ch.start; p < end; ++p) { positions.push_back(p); slots.push_back(ctx[p]); }
    views[ci] = AttentionChunk{row, ch.start, ch.num_tokens, ctx, offset};
    if (c.hybrid && ch.state_slot < 0) throw std::logic_error("a chunk of a hybrid model has no state slot");
    delta_chunks[ci] = DeltaChunk{row, ch.num_tokens, ch.state_slot, ch.start == 0};
    row += ch.num_tokens;
    if (ch.all_logits) {
      for (int64_t r = row - ch.num_tokens; r < row; ++r) logit_rows.push_back(r);
    } else if (ch.wants_logits) {
      logit_rows.push_back(row - 1);
    }
  }
  if (row != T) throw std::logic_error("chunk sizes do not add up to the tokens given");
  // The 4-bit products for a decode step of up to kQ4Rows rows (one token of each sequence past its prompt, or a
  // verify chunk, whose rows are decode positions), as the Torch plane's int4 layers do; prompts go through the
  // float32 weights (8-bit activations at every prompt position lose the large activations some tokens carry:
  // SmolLM2's answer to a chat went astray).
  bool q4 = q4_layers_ > 0 && T <= kQ4Rows;
  for (const Chunk& ch : chunks) q4 = q4 && (ch.num_tokens == 1 || ch.all_logits) && ch.start > 0;
  at::Tensor ids = at::tensor(tokens, at::kLong).to(device_);
  at::Tensor pos = at::tensor(positions, at::kLong).to(device_);
  at::Tensor slot = at::tensor(slots, at::kLong).to(device_);
  at::Tensor context_slots = aten_ops_ ? at::tensor(contexts, at::kLong).to(device_) : at::Tensor();
  at::Tensor freqs = pos.to(at::kFloat).unsqueeze(1) * inv_freq_.unsqueeze(0);   // [T, D/2]
  at::Tensor cos = freqs.cos().unsqueeze(1), sin = freqs.sin().unsqueeze(1);
  at::Tensor x = embed_.index_select(0, ids).contiguous();
  // A decode step's dense 4-bit layers run in q4_decode_layer, with the rotary tables as it reads them.
  at::Tensor cos_rows, sin_rows;
  if (q4 && q4_fused_any_) {
    q4_layer_scratch_.reserve(T, q4_shape_);
    at::Tensor c2 = cos.squeeze(1), s2 = sin.squeeze(1);
    cos_rows = at::cat({c2, c2}, 1).contiguous();
    sin_rows = at::cat({-s2, s2}, 1).contiguous();
  }
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    if (cos_rows.defined() && q4_layers_fused_[li].qkv_q4.defined()) {
      q4_decode_layer(x.data_ptr<float>(), T, q4_layers_fused_[li], q4_shape_, cos_rows.data_ptr<float>(),
                      sin_rows.data_ptr<float>(), slots.data(), k_cache_[li], v_cache_[li], views,
                      q4_layer_scratch_);
      continue;
    }
    at::Tensor h = rms_norm(x, l.input_norm, c.rms_norm_eps);
    x = x + (l.delta ? l.delta->forward(h, delta_chunks) : attention(li, h, slot, cos, sin, views, context_slots, q4));
    h = rms_norm(x, l.post_norm, c.rms_norm_eps);
    if (l.router.defined()) {
      x = x + moe(l, h);
    } else {
      at::Tensor gu = linear(h, l.gate_up, l.gate_up_q4, q4);
      at::Tensor act = at::silu(gu.narrow(1, 0, c.intermediate_size)) * gu.narrow(1, c.intermediate_size, c.intermediate_size);
      x = x + linear(act, l.down, l.down_q4, q4);
    }
  }
  if (logit_rows.empty()) return at::empty({0, c.vocab_size});
  at::Tensor last = x.index_select(0, at::tensor(logit_rows, at::kLong).to(device_));
  return logits(rms_norm(last, final_norm_, c.rms_norm_eps), q4).to(at::kCPU);
}

}  // namespace pocket
