// The Qwen3 forward (qwen_model.h): RMSNorm, fused QKV with per-head q/k norms, rotary embedding (halves
// rotated), paged causal attention with grouped KV heads, SwiGLU MLP, and the (possibly tied) LM head.
#include "qwen_model.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "json.h"
#include "paged_attention.h"
#include "safetensors.h"

namespace pocket {
namespace {

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

// Rotate the halves of the last dimension by the angles of `cos`/`sin` ([T, 1, D/2]).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

}  // namespace

QwenConfig read_qwen_config(const std::string& directory) {
  Json cfg = read_json(directory + "/config.json");
  if (const Json* text = cfg.find("text_config"); text && text->is_object()) cfg = *text;
  QwenConfig c;
  c.model_type = cfg.has("model_type") ? cfg.at("model_type").as_string() : "";
  const Json* archs = cfg.find("architectures");
  c.architecture = archs && archs->is_array() && !archs->array.empty() ? archs->array[0].as_string() : "";
  if (c.model_type != "qwen3" && c.model_type != "qwen3_moe")
    throw std::invalid_argument("the native engine runs Qwen3 and Qwen3-MoE checkpoints (model_type 'qwen3', "
                                "'qwen3_moe'); this one is '" + c.model_type + "'");
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
  c.intermediate_size = int_of(cfg, "intermediate_size");
  c.num_layers = int_of(cfg, "num_hidden_layers");
  c.num_heads = int_of(cfg, "num_attention_heads");
  c.num_kv_heads = cfg.has("num_key_value_heads") ? int_of(cfg, "num_key_value_heads") : c.num_heads;
  const Json* hd = cfg.find("head_dim");
  c.head_dim = hd && hd->is_number() ? hd->as_int() : c.hidden_size / c.num_heads;
  c.max_position_embeddings = cfg.has("max_position_embeddings") ? int_of(cfg, "max_position_embeddings") : 32768;
  if (const Json* v = cfg.find("rms_norm_eps"); v && v->is_number()) c.rms_norm_eps = v->as_double();
  if (const Json* v = cfg.find("tie_word_embeddings"); v && v->type == Json::Type::Bool) c.tie_word_embeddings = v->boolean;
  if (const Json* v = cfg.find("attention_bias"); v && v->type == Json::Type::Bool) c.attention_bias = v->boolean;
  const Json* rope_params = cfg.find("rope_parameters");
  if (!rope_params || rope_params->is_null()) rope_params = cfg.find("rope_scaling");
  if (const Json* v = cfg.find("rope_theta"); v && v->is_number()) c.rope_theta = v->as_double();
  if (rope_params && rope_params->is_object()) {
    if (const Json* v = rope_params->find("rope_theta"); v && v->is_number()) c.rope_theta = v->as_double();
    const Json* type = rope_params->find("rope_type");
    if (!type) type = rope_params->find("type");
    if (type && type->is_string() && type->as_string() != "default")
      throw std::invalid_argument("rope type '" + type->as_string() + "' is not implemented by the native engine");
  }
  if (const Json* v = cfg.find("use_sliding_window"); v && v->type == Json::Type::Bool && v->boolean)
    throw std::invalid_argument("sliding-window attention is not implemented by the native engine");
  if (c.head_dim % 2 != 0 || c.num_heads % c.num_kv_heads != 0)
    throw std::invalid_argument("config.json: head_dim must be even and the heads a multiple of the KV heads");
  if (const Json* v = cfg.find("eos_token_id")) {
    if (v->is_number()) c.eos_token_ids.push_back(v->as_int());
    for (const Json& e : v->array) c.eos_token_ids.push_back(e.as_int());
  }
  return c;
}

bool QwenConfig::is_moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  for (int64_t dense : mlp_only_layers)
    if (dense == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

QwenModel::QwenModel(const std::string& directory, const QwenConfig& config) : config_(config) {
  TensorMap w = load_safetensors_dir(directory);
  for (const auto& [name, t] : w) {
    num_parameters_ += t.numel();
    if (name == "model.embed_tokens.weight" && !config_.tie_word_embeddings) continue;   // one row per token
    const bool routed = name.find(".mlp.experts.") != std::string::npos;   // top-k of the experts per token
    decode_weight_bytes_ += routed ? t.numel() * 4 * config_.experts_per_token / config_.num_experts : t.numel() * 4;
  }
  embed_ = take(w, "model.embed_tokens.weight");
  if (embed_.size(0) != config_.vocab_size || embed_.size(1) != config_.hidden_size)
    throw std::invalid_argument("model.embed_tokens.weight does not match config.json's sizes");
  final_norm_ = take(w, "model.norm.weight");
  auto head = w.find("lm_head.weight");
  if (head != w.end()) { lm_head_ = head->second; w.erase(head); }
  else if (config_.tie_word_embeddings) lm_head_ = embed_;
  else throw std::invalid_argument("checkpoint has no lm_head.weight and does not tie it to the embeddings");
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = take(w, p + "input_layernorm.weight");
    l.post_norm = take(w, p + "post_attention_layernorm.weight");
    at::Tensor q = take(w, p + "self_attn.q_proj.weight"), k = take(w, p + "self_attn.k_proj.weight"),
               v = take(w, p + "self_attn.v_proj.weight");
    if (q.size(0) != config_.num_heads * config_.head_dim || k.size(0) != config_.num_kv_heads * config_.head_dim)
      throw std::invalid_argument("attention projections of layer " + std::to_string(i) + " do not match config.json");
    l.qkv = at::cat({q, k, v}, 0).contiguous();
    if (w.count(p + "self_attn.q_proj.bias"))
      l.qkv_bias = at::cat({take(w, p + "self_attn.q_proj.bias"), take(w, p + "self_attn.k_proj.bias"),
                            take(w, p + "self_attn.v_proj.bias")}, 0);
    l.o_proj = take(w, p + "self_attn.o_proj.weight");
    l.q_norm = take(w, p + "self_attn.q_norm.weight");
    l.k_norm = take(w, p + "self_attn.k_norm.weight");
    if (config_.is_moe_layer(i)) {
      l.router = take(w, p + "mlp.gate.weight");
      for (int64_t e = 0; e < config_.num_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        l.expert_gate_up.push_back(
            at::cat({take(w, x + "gate_proj.weight"), take(w, x + "up_proj.weight")}, 0).contiguous());
        l.expert_down.push_back(take(w, x + "down_proj.weight"));
      }
    } else {
      l.gate_up = at::cat({take(w, p + "mlp.gate_proj.weight"), take(w, p + "mlp.up_proj.weight")}, 0).contiguous();
      l.down = take(w, p + "mlp.down_proj.weight");
    }
    layers_.push_back(std::move(l));
  }
  if (!w.empty())
    throw std::invalid_argument("checkpoint tensor " + w.begin()->first + " is not used by the native Qwen3 engine");
  inv_freq_ = 1.0 / at::pow(config_.rope_theta,
                            at::arange(0, config_.head_dim, 2, at::kLong).to(at::kFloat) / config_.head_dim);
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
  const int64_t* ids = experts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(c.num_experts), slots(c.num_experts);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      rows[ids[t * K + k]].push_back(t);
      slots[ids[t * K + k]].push_back(t * K + k);
    }
  at::Tensor flat_weights = weights.reshape({-1});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (rows[e].empty()) continue;
    at::Tensor idx = at::tensor(rows[e], at::kLong);
    at::Tensor gu = at::linear(h.index_select(0, idx), l.expert_gate_up[e]);
    at::Tensor y = at::linear(at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I), l.expert_down[e]);
    y = y * flat_weights.index_select(0, at::tensor(slots[e], at::kLong)).unsqueeze(1);
    out.index_add_(0, idx, y);
  }
  return out;
}

void QwenModel::allocate_cache(int64_t num_blocks, int64_t block_size) {
  block_size_ = block_size;
  k_cache_.clear();
  v_cache_.clear();
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    // Pages are touched when a block is first written; a slot is read only after its position was written.
    k_cache_.push_back(at::empty({num_blocks * block_size, config_.num_kv_heads, config_.head_dim}));
    v_cache_.push_back(at::empty({num_blocks * block_size, config_.num_kv_heads, config_.head_dim}));
  }
}

at::Tensor QwenModel::forward(const std::vector<int64_t>& tokens, const std::vector<Chunk>& chunks) {
  c10::InferenceMode inference;
  const QwenConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t H = c.num_heads, KVH = c.num_kv_heads, D = c.head_dim, bs = block_size_;
  // Positions and cache slots of the new tokens, and per chunk the slots of its whole context.
  std::vector<int64_t> positions, slots, logit_rows;
  std::vector<std::vector<int64_t>> contexts(chunks.size());
  std::vector<AttentionChunk> views(chunks.size());
  positions.reserve(T);
  slots.reserve(T);
  int64_t row = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const Chunk& ch = chunks[ci];
    const auto& table = *ch.block_table;
    const int64_t end = ch.start + ch.num_tokens;
    if (static_cast<int64_t>(table.size()) * bs < end) throw std::logic_error("block table too short for a chunk");
    std::vector<int64_t>& ctx = contexts[ci];
    ctx.resize(static_cast<size_t>(end));
    for (int64_t p = 0; p < end; ++p) ctx[p] = table[p / bs] * bs + p % bs;
    for (int64_t p = ch.start; p < end; ++p) { positions.push_back(p); slots.push_back(ctx[p]); }
    views[ci] = AttentionChunk{row, ch.start, ch.num_tokens, ctx.data()};
    row += ch.num_tokens;
    if (ch.wants_logits) logit_rows.push_back(row - 1);
  }
  if (row != T) throw std::logic_error("chunk sizes do not add up to the tokens given");
  at::Tensor ids = at::tensor(tokens, at::kLong);
  at::Tensor pos = at::tensor(positions, at::kLong);
  at::Tensor slot = at::tensor(slots, at::kLong);
  at::Tensor freqs = pos.to(at::kFloat).unsqueeze(1) * inv_freq_.unsqueeze(0);   // [T, D/2]
  at::Tensor cos = freqs.cos().unsqueeze(1), sin = freqs.sin().unsqueeze(1);
  at::Tensor x = embed_.index_select(0, ids);
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    at::Tensor h = rms_norm(x, l.input_norm, c.rms_norm_eps);
    at::Tensor qkv = l.qkv_bias.defined() ? at::linear(h, l.qkv, l.qkv_bias) : at::linear(h, l.qkv);
    at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    at::Tensor k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
    at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    q = rope(rms_norm(q, l.q_norm, c.rms_norm_eps), cos, sin);
    k = rope(rms_norm(k, l.k_norm, c.rms_norm_eps), cos, sin);
    k_cache_[li].index_copy_(0, slot, k);
    v_cache_[li].index_copy_(0, slot, v);
    at::Tensor attn = at::empty({T, H, D});
    q = q.contiguous();
    paged_attention(q.data_ptr<float>(), k_cache_[li].data_ptr<float>(), v_cache_[li].data_ptr<float>(),
                    attn.data_ptr<float>(), views, H, KVH, D, static_cast<float>(1.0 / std::sqrt(double(D))));
    x = x + at::linear(attn.view({T, H * D}), l.o_proj);
    h = rms_norm(x, l.post_norm, c.rms_norm_eps);
    if (l.router.defined()) {
      x = x + moe(l, h);
    } else {
      at::Tensor gu = at::linear(h, l.gate_up);
      at::Tensor act = at::silu(gu.narrow(1, 0, c.intermediate_size)) * gu.narrow(1, c.intermediate_size, c.intermediate_size);
      x = x + at::linear(act, l.down);
    }
  }
  if (logit_rows.empty()) return at::empty({0, c.vocab_size});
  at::Tensor last = x.index_select(0, at::tensor(logit_rows, at::kLong));
  return at::linear(rms_norm(last, final_norm_, c.rms_norm_eps), lm_head_);
}

}  // namespace pocket
