// QwenEngine (qwen_engine.h).
#include "qwen_engine.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "gguf.h"
#include "gguf_checkpoint.h"
#include "q4_weights.h"
#include "json.h"

namespace pocket {
namespace {

int64_t blocks_for(const QwenConfig& c, const QwenEngineOptions& o) {
  if (o.block_size < 1) throw std::invalid_argument("block_size must be >= 1");
  if (o.num_kv_blocks > 0) return o.num_kv_blocks;
  if (!(o.kv_cache_mb > 0)) throw std::invalid_argument("kv_cache_mb must be positive");
  const double per_block =
      2.0 * std::max<int64_t>(1, c.num_attention_layers()) * o.block_size * c.num_kv_heads * c.head_dim * 4.0;
  return std::max<int64_t>(1, static_cast<int64_t>(o.kv_cache_mb * 1024.0 * 1024.0 / per_block));
}

std::vector<int64_t> generation_config_eos(const std::string& checkpoint) {
  std::ifstream in(checkpoint + "/generation_config.json");
  std::vector<int64_t> out;
  if (!in) return out;
  std::stringstream buf;
  buf << in.rdbuf();
  Json j = Json::parse(buf.str());
  if (const Json* v = j.find("eos_token_id")) {
    if (v->is_number()) out.push_back(v->as_int());
    for (const Json& e : v->array) out.push_back(e.as_int());
  }
  return out;
}

// The GGML type holding most elements of the layers' matrices (blk.* tensors of two or more dimensions), as the
// Python loader's linear_weight_type counts it; -1 when there are none.
int64_t linear_weight_type(const GgufFile& file) {
  std::map<uint32_t, int64_t> counts;
  for (const GgufTensor& t : file.tensors())
    if (t.name.rfind("blk.", 0) == 0 && t.shape.size() >= 2) counts[t.type] += t.numel();
  int64_t best = -1, most = -1;
  for (const auto& [type, n] : counts)
    if (n > most) { most = n; best = type; }
  return best;
}

constexpr int64_t kGgmlQ4_1 = 3;

// The device options.device names ("auto": CUDA where this build has it and a device is there).
std::string resolve_device(const std::string& device) {
  if (device != "auto") return device;
#ifdef POCKET_CUDA
  if (at::hasCUDA()) return "cuda";
#endif
  return "cpu";
}

// A checkpoint directory's safetensors, or a .gguf file's tensors dequantised (the dense layers' linear weights
// then held as 4-bit records for weight_format "auto" on a Q4_1 file, where the CPU runs the kernel), placed on
// the options' device.
QwenModel load_model(const std::string& checkpoint, const QwenEngineOptions& options) {
  if (options.weight_format != "auto" && options.weight_format != "float32")
    throw std::invalid_argument("weight_format must be 'auto' or 'float32', not '" + options.weight_format + "'");
  const std::string device = resolve_device(options.device);
  if (!is_gguf_path(checkpoint)) {
    QwenModel model(checkpoint, read_qwen_config(checkpoint));
    model.place(device, options.aten_ops);
    return model;
  }
  GgufFile file(checkpoint);
  QwenConfig config = read_gguf_config(file);
  QwenModel model(load_gguf_weights(file, config), config);
  if (options.weight_format == "auto" && linear_weight_type(file) == kGgmlQ4_1 && q4_kernel_supported() &&
      device == "cpu" && !options.aten_ops)
    model.use_q4_weights();
  model.place(device, options.aten_ops);
  return model;
}

}  // namespace

QwenConfig checkpoint_config(const std::string& checkpoint) {
  return is_gguf_path(checkpoint) ? read_gguf_config(GgufFile(checkpoint)) : read_qwen_config(checkpoint);
}

QwenEngine::QwenEngine(const std::string& checkpoint, const QwenEngineOptions& options)
    : options_(options),
      model_(load_model(checkpoint, options)),
      pool_(blocks_for(model_.config(), options), options.block_size,
            options.prefix_caching && (!model_.config().hybrid || options.state_snapshots > 0)),
      snapshots_(options.state_snapshots) {
  // A hybrid model resumes a cached block prefix only from a kept state: no snapshots, no prefix caching.
  options_.prefix_caching = pool_.prefix_caching();
  if (options.state_snapshots < 0) throw std::invalid_argument("state_snapshots must be >= 0");
  validate_sampling(options.sampling);
  if (options.max_slots < 1) throw std::invalid_argument("max_slots must be >= 1");
  if (options.num_threads > 0) at::set_num_threads(static_cast<int>(options.num_threads));
  model_.allocate_cache(pool_.num_blocks(), pool_.block_size());
  const int64_t capacity = pool_.num_blocks() * pool_.block_size();
  max_model_len_ = std::min(model_.config().max_position_embeddings, capacity);
  if (options.max_model_len > 0) {
    if (options.max_model_len > max_model_len_)
      throw std::invalid_argument("max_model_len " + std::to_string(options.max_model_len) + " is more than the " +
                                  std::to_string(max_model_len_) + " tokens the checkpoint and KV cache allow");
    max_model_len_ = options.max_model_len;
  }
  if (!options.eos_token_ids.empty()) {
    eos_ = options.eos_token_ids;
    eos_source_ = "options";
  } else if (auto g = is_gguf_path(checkpoint) ? std::vector<int64_t>() : generation_config_eos(checkpoint);
             !g.empty()) {
    eos_ = g;
    eos_source_ = "generation_config";
  } else if (!model_.config().eos_token_ids.empty()) {
    eos_ = model_.config().eos_token_ids;
    eos_source_ = "config";
  } else {
    eos_source_ = "none";
  }
}

void QwenEngine::validate_prompt(const std::vector<int64_t>& prompt, int64_t max_new_tokens) const {
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (static_cast<int64_t>(prompt.size()) >= max_model_len_)
    throw std::invalid_argument("the prompt has " + std::to_string(prompt.size()) + " tokens; this engine's context is " +
                                std::to_string(max_model_len_) + " tokens and needs room for a generated token");
  for (int64_t t : prompt)
    if (t < 0 || t >= model_.config().vocab_size)
      throw std::invalid_argument("prompt token id " + std::to_string(t) + " is outside the vocabulary");
  if (max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
}

void QwenEngine::start(Sequence& seq) {
  // At least the last prompt token is computed, so that its logits exist.
  const int64_t limit = static_cast<int64_t>(seq.tokens.size()) - 1;
  if (!keeps_states()) {
    seq.num_computed = pool_.match(seq.tokens, limit, seq.table, seq.hashed, seq.last_hash);
  } else {
    seq.num_computed = pool_.match(seq.tokens, limit, seq.table, seq.hashed, seq.last_hash,
                                   [this](uint64_t h) { return snapshots_.contains(h); });
    if (seq.num_computed > 0) {
      if (seq.state_slot < 0) seq.state_slot = model_.acquire_state_slot();
      model_.copy_state_slot(snapshots_.find(seq.last_hash), seq.state_slot);
    }
  }
  seq.num_cached = seq.num_computed;
}

std::vector<int64_t> QwenEngine::snapshot_points(const Sequence& seq) const {
  const int64_t bs = pool_.block_size();
  const int64_t last = (seq.num_prompt - 1) / bs * bs, end = seq.num_prompt / bs * bs;
  std::vector<int64_t> points;
  if (last > 0) points.push_back(last);
  if (end > last) points.push_back(end);
  return points;
}

bool QwenEngine::at_registered_boundary(const Sequence& seq) const {
  return seq.hashed * pool_.block_size() == seq.num_computed;
}

void QwenEngine::keep_state(const Sequence& seq) {
  // Only at a registered block boundary: the key is the chained hash of the blocks before it.
  if (!at_registered_boundary(seq) || snapshots_.find(seq.last_hash) >= 0) return;
  const int64_t slot = snapshots_.claim(seq.last_hash, snapshots_.full() ? -1 : model_.acquire_state_slot());
  model_.copy_state_slot(seq.state_slot, slot);
}

void QwenEngine::keep_decode_state(Sequence& seq) {
  // Past the prompt, with no unverified proposal in the state, exactly at a registered block boundary.
  if (seq.drafted > 0 || seq.num_computed <= seq.num_prompt || !at_registered_boundary(seq)) return;
  const uint64_t previous = seq.decode_snapshot;
  keep_state(seq);   // kept now, or held already (another sequence reached the same prefix): this one's latest
  seq.decode_snapshot = seq.last_hash;
  if (previous != 0 && previous != seq.last_hash) model_.release_state_slot(snapshots_.release(previous));
}

at::Tensor QwenEngine::forward_chunks(const std::vector<Sequence*>& seqs, const std::vector<int64_t>& n) {
  std::vector<int64_t> tokens;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& s = *seqs[i];
    if (model_.config().hybrid && s.state_slot < 0) s.state_slot = model_.acquire_state_slot();
    Chunk c;
    c.start = s.num_computed;
    c.num_tokens = n[i];
    c.block_table = &s.table;
    c.state_slot = s.state_slot;
    c.wants_logits = s.num_computed + n[i] == static_cast<int64_t>(s.tokens.size());
    c.all_logits = s.drafted > 0;
    tokens.insert(tokens.end(), s.tokens.begin() + c.start, s.tokens.begin() + c.start + c.num_tokens);
    chunks.push_back(c);
  }
  at::Tensor logits = model_.forward(tokens, chunks);
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& s = *seqs[i];
    s.num_computed += n[i];
    pool_.register_full(s.tokens, s.num_computed - s.drafted, s.table, s.hashed, s.last_hash);
  }
  return logits.contiguous();
}

int64_t QwenEngine::checkpoint_state(const Sequence& seq) {
  if (!model_.config().hybrid || seq.state_slot < 0) return -1;
  const int64_t saved = model_.acquire_state_slot();
  model_.copy_state_slot(seq.state_slot, saved);
  return saved;
}

void QwenEngine::drop_checkpoint(int64_t saved) { model_.release_state_slot(saved); }

void QwenEngine::rewind_state(Sequence& seq, int64_t saved, int64_t count) {
  model_.copy_state_slot(saved, seq.state_slot);
  model_.release_state_slot(saved);
  Chunk chunk;
  chunk.start = seq.num_computed - count;
  chunk.num_tokens = count;
  chunk.block_table = &seq.table;
  chunk.state_slot = seq.state_slot;
  model_.forward(std::vector<int64_t>(seq.tokens.begin() + chunk.start, seq.tokens.begin() + chunk.start + count),
                 {chunk});
}

at::Tensor QwenEngine::run(const std::vector<Sequence*>& seqs, const std::vector<int64_t>& n) {
  if (!keeps_states()) return forward_chunks(seqs, n);
  std::vector<int64_t> left(n);
  std::vector<at::Tensor> rows(seqs.size());
  at::Tensor only;   // the logits when one forward did it all
  for (int pass = 0;; ++pass) {
    std::vector<Sequence*> part;
    std::vector<int64_t> counts;
    std::vector<size_t> which;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (left[i] <= 0) continue;
      const int64_t from = seqs[i]->num_computed;
      int64_t to = from + left[i];
      for (int64_t p : snapshot_points(*seqs[i]))
        if (p > from && p < to) to = p;
      part.push_back(seqs[i]);
      counts.push_back(to - from);
      which.push_back(i);
    }
    if (part.empty()) break;
    at::Tensor logits = forward_chunks(part, counts);
    int64_t row = 0;
    for (size_t j = 0; j < part.size(); ++j) {
      Sequence& s = *part[j];
      left[which[j]] -= counts[j];
      // A sequence's rows, appended pass by pass (a chunk with proposals gives every row's logits).
      const int64_t got = s.drafted > 0 ? counts[j] : s.num_computed == static_cast<int64_t>(s.tokens.size());
      if (got > 0) {
        at::Tensor part = logits.narrow(0, row, got);
        rows[which[j]] = rows[which[j]].defined() ? at::cat({rows[which[j]], part}) : part;
        row += got;
      }
      for (int64_t p : snapshot_points(s))
        if (s.num_computed == p) keep_state(s);
      keep_decode_state(s);
    }
    if (pass == 0 && std::all_of(left.begin(), left.end(), [](int64_t l) { return l <= 0; })) only = logits;
  }
  if (only.defined()) return only;
  std::vector<at::Tensor> kept;
  for (const at::Tensor& r : rows)
    if (r.defined()) kept.push_back(r);
  if (kept.empty()) return at::empty({0, model_.config().vocab_size}, at::kFloat);
  return at::cat(kept).contiguous();
}

void QwenEngine::finish(Sequence& seq) {
  pool_.register_full(seq.tokens, seq.num_computed, seq.table, seq.hashed, seq.last_hash);
  pool_.release(seq.table);
  model_.release_state_slot(seq.state_slot);
  seq.state_slot = -1;
}

int64_t QwenEngine::sample_session(const at::Tensor& logits) {
  Sequence& s = *session_;
  const float* row = logits.data_ptr<float>();
  const int64_t vocab = logits.size(1);
  std::vector<float> processed;
  if (needs_processing(s.sampling)) processed = process_logits(row, vocab, s.sampling, s.tokens, s.num_prompt);
  const int64_t token = sample_token(processed.empty() ? row : processed.data(), vocab, s.sampling, s.rng);
  s.tokens.push_back(token);
  ++s.num_generated;
  return token;
}

int64_t QwenEngine::prefill(const std::vector<int64_t>& prompt) {
  auto guard = lock();
  validate_prompt(prompt, 1);
  if (session_) finish(*session_);
  session_.reset();
  auto seq = std::make_unique<Sequence>();
  seq->id = "session";
  seq->tokens = prompt;
  seq->num_prompt = static_cast<int64_t>(prompt.size());
  seq->sampling = options_.sampling;
  seq->rng.seed(options_.sampling.seed >= 0 ? static_cast<uint64_t>(options_.sampling.seed) : std::random_device{}());
  start(*seq);
  if (!pool_.grow(seq->table, static_cast<int64_t>(prompt.size()))) {
    pool_.release(seq->table);
    throw std::runtime_error("the KV cache has too few free blocks for this prompt");
  }
  session_ = std::move(seq);
  at::Tensor logits = run({session_.get()}, {static_cast<int64_t>(prompt.size()) - session_->num_computed});
  return sample_session(logits);
}

int64_t QwenEngine::decode_step() {
  auto guard = lock();
  if (!session_) throw std::runtime_error("decode_step needs a prefill first");
  Sequence& s = *session_;
  if (static_cast<int64_t>(s.tokens.size()) >= max_model_len_)
    throw std::runtime_error("the session has reached the engine's context of " + std::to_string(max_model_len_) +
                             " tokens");
  if (!pool_.grow(s.table, static_cast<int64_t>(s.tokens.size())))
    throw std::runtime_error("the KV cache has no free block for the next token");
  at::Tensor logits = run({&s}, {1});
  return sample_session(logits);
}

std::vector<int64_t> QwenEngine::decode(int64_t max_new_tokens) {
  if (max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
  std::vector<int64_t> out;
  while (static_cast<int64_t>(out.size()) < max_new_tokens && session_length() < max_model_len_) {
    out.push_back(decode_step());
    if (std::find(eos_.begin(), eos_.end(), out.back()) != eos_.end()) break;
  }
  return out;
}

std::vector<int64_t> QwenEngine::verify(const std::vector<int64_t>& draft) {
  auto guard = lock();
  if (!session_) throw std::runtime_error("verify needs a prefill first");
  Sequence& s = *session_;
  const int64_t k = static_cast<int64_t>(draft.size());
  const int64_t length = static_cast<int64_t>(s.tokens.size());
  for (int64_t t : draft)
    if (t < 0 || t >= model_.config().vocab_size)
      throw std::invalid_argument("draft token id " + std::to_string(t) + " is outside the vocabulary");
  if (length + k >= max_model_len_)
    throw std::invalid_argument("a draft of " + std::to_string(k) + " tokens after " + std::to_string(length) +
                                " would pass the engine's context of " + std::to_string(max_model_len_) + " tokens");
  if (!pool_.grow(s.table, length + k))
    throw std::runtime_error("the KV cache has too few free blocks for the draft");
  // The last token returned (not yet computed) and the draft, in one chunk with every position's logits.
  std::vector<int64_t> tokens{s.tokens.back()};
  tokens.insert(tokens.end(), draft.begin(), draft.end());
  const int64_t saved = k > 0 ? checkpoint_state(s) : -1;
  Chunk chunk;
  chunk.start = s.num_computed;
  chunk.num_tokens = k + 1;
  chunk.block_table = &s.table;
  chunk.state_slot = s.state_slot;
  chunk.all_logits = true;
  at::Tensor logits;
  try {
    logits = model_.forward(tokens, {chunk}).contiguous();
  } catch (...) {
    if (saved >= 0) {
      model_.copy_state_slot(saved, s.state_slot);
      model_.release_state_slot(saved);
    }
    throw;
  }
  std::vector<int64_t> out;
  for (int64_t i = 0; i <= k; ++i) {
    out.push_back(sample_session(logits.select(0, i).unsqueeze(0)));
    if (i == k || out.back() != draft[i]) break;
  }
  const int64_t kept = static_cast<int64_t>(out.size()) - 1;
  s.num_computed += kept + 1;
  // The state went past a rejected token: back to before the chunk, then over the kept tokens.
  if (saved >= 0 && kept < k) {
    rewind_state(s, saved, kept + 1);
  } else {
    drop_checkpoint(saved);
  }
  pool_.register_full(s.tokens, s.num_computed, s.table, s.hashed, s.last_hash);
  return out;
}

double QwenEngine::warmup() {
  auto guard = lock();
  const auto started = std::chrono::steady_clock::now();
  Sequence seq;
  seq.tokens.assign(static_cast<size_t>(std::min<int64_t>(8, max_model_len_ - 1)), 0);
  if (!pool_.grow(seq.table, static_cast<int64_t>(seq.tokens.size()) + 1))
    throw std::runtime_error("the KV cache has too few free blocks to warm up");
  if (model_.config().hybrid) seq.state_slot = model_.acquire_state_slot();
  Chunk chunk;
  chunk.num_tokens = static_cast<int64_t>(seq.tokens.size());
  chunk.block_table = &seq.table;
  chunk.state_slot = seq.state_slot;
  chunk.wants_logits = true;
  try {
    model_.forward(seq.tokens, {chunk});
    chunk.start = chunk.num_tokens;
    chunk.num_tokens = 1;
    model_.forward({0}, {chunk});
  } catch (...) {
    pool_.release(seq.table);
    model_.release_state_slot(seq.state_slot);
    throw;
  }
  // Released without registering: the scratch tokens never enter the prefix cache.
  pool_.release(seq.table);
  model_.release_state_slot(seq.state_slot);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
}

std::vector<int64_t> QwenEngine::generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens) {
  if (max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
  std::vector<int64_t> out{prefill(prompt)};
  while (static_cast<int64_t>(out.size()) < max_new_tokens &&
         static_cast<int64_t>(prompt.size() + out.size()) < max_model_len_)
    out.push_back(decode_step());
  return out;
}

void QwenEngine::reset() {
  auto guard = lock();
  if (session_) {
    pool_.release(session_->table);
    model_.release_state_slot(session_->state_slot);
  }
  session_.reset();
  pool_.clear_prefix_cache();
  for (int64_t slot : snapshots_.clear()) model_.release_state_slot(slot);
}

int64_t QwenEngine::session_cached_tokens() const { return session_ ? session_->num_cached : 0; }

int64_t QwenEngine::session_length() const { return session_ ? static_cast<int64_t>(session_->tokens.size()) : 0; }

}  // namespace pocket
