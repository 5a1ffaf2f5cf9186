// QwenEngine: a loaded Qwen3 or Qwen3.5 model with its KV pool, a single-session token API (prefill, decode_step,
// decode, verify, generate, warmup, reset) and the batched step the batch core schedules onto.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kv_pool.h"
#include "qwen_model.h"
#include "sampler.h"
#include "state_snapshots.h"

namespace pocket {

struct QwenEngineOptions {
  int64_t block_size = 16;
  int64_t num_kv_blocks = 0;        // 0: from kv_cache_mb
  double kv_cache_mb = 512.0;
  int64_t max_model_len = 0;        // 0: the checkpoint's, bounded by the KV cache
  int64_t max_slots = 64;           // most sequences one batched step runs
  bool prefix_caching = true;
  // Hybrid models (Qwen3.5): how many recurrent states after a cached prompt prefix are kept, for the prefix cache
  // to resume from (0: no prefix caching for them). A prompt's state is kept at its last block boundary (and at
  // its end when that is one); each costs one state slot.
  int64_t state_snapshots = 16;
  int64_t num_threads = 0;          // 0: libtorch's default
  std::vector<int64_t> eos_token_ids;   // empty: generation_config.json's, else config.json's
  SamplingOptions sampling;         // the single-session API's sampling (greedy by default)
  // "auto": a GGUF whose layers' matrices are mostly Q4_1 keeps its dense layers' linear weights as 4-bit records
  // multiplied by the project's AVX-512 VNNI kernel (q4_weights.h) where the CPU has it, as the Torch plane's
  // cpu_weight_format "auto" does; "float32": every weight dequantised to float32.
  std::string weight_format = "auto";
  // Where the model runs: "cpu", "cuda" / "cuda:N" (a CUDA build), or "auto": the first CUDA device where this
  // build has CUDA and one is available, else the CPU.
  std::string device = "auto";
  // Attention and the Gated DeltaNet as ATen operations on the CPU too (the form a CUDA device runs), instead of
  // the CPU loops: a reference for the CUDA path that runs without a GPU.
  bool aten_ops = false;
};

// One sequence's tokens (prompt then outputs), KV blocks and sampling state.
struct Sequence {
  std::string id;
  std::vector<int64_t> tokens;
  int64_t num_prompt = 0;
  int64_t num_computed = 0;     // tokens whose KV is in the cache
  int64_t num_cached = 0;       // of the prompt, found in the prefix cache
  int64_t num_generated = 0;    // sampled tokens, an EOS included
  int64_t drafted = 0;          // trailing tokens that are proposals being verified (every row's logits wanted)
  std::vector<int64_t> table;
  int64_t state_slot = -1;      // hybrid models: the recurrent-state slot while it has computed tokens
  int64_t hashed = 0;
  uint64_t last_hash = 0;
  // Hybrid models: the key of the state this sequence last kept at a block boundary its decoding reached (0:
  // none), given up when it keeps the next one.
  uint64_t decode_snapshot = 0;
  SamplingOptions sampling;
  std::mt19937_64 rng;
};

class QwenEngine {
 public:
  // `checkpoint`: a safetensors checkpoint directory, or a .gguf file (llama, qwen2 or qwen3 architecture).
  QwenEngine(const std::string& checkpoint, const QwenEngineOptions& options);

  const QwenConfig& config() const { return model_.config(); }
  const QwenEngineOptions& options() const { return options_; }
  const std::vector<int64_t>& eos_token_ids() const { return eos_; }
  const std::string& eos_source() const { return eos_source_; }
  std::string device() const { return model_.device().str(); }
  int64_t eos_id() const { return eos_.empty() ? -1 : eos_.front(); }
  int64_t max_model_len() const { return max_model_len_; }
  int64_t num_parameters() const { return model_.num_parameters(); }
  int64_t decode_weight_bytes() const { return model_.decode_weight_bytes(); }
  // The linear weights' format as run: "int4" (4-bit records) or "float32".
  std::string weight_format() const { return model_.q4_weights() ? "int4" : "float32"; }

  // Single session: prefill starts a new sequence (reusing cached prefix blocks) and returns its first token.
  int64_t prefill(const std::vector<int64_t>& prompt);
  int64_t decode_step();   // the next token after the last one returned; throws without a session
  // Up to `max_new_tokens` decode steps; the first EOS token ends them (it is the last token returned), and none
  // runs past the engine's context.
  std::vector<int64_t> decode(int64_t max_new_tokens);
  // Speculative decoding: `draft` proposes the tokens after the last one returned. One forward scores the last
  // token and the draft; at each position the session's sampler draws a token, and a draft token is kept while it
  // equals the draw. Returns the kept draft tokens and then the first draw that differed (or the draw after the
  // whole draft): 1 to draft.size() + 1 tokens, each the token decode_step would have returned with the same
  // random stream (a draw that equals a fixed proposal is accepted with exactly its probability, and a rejection
  // leaves the rest of the distribution). KV slots of rejected tokens are overwritten later; a hybrid model's
  // recurrent state is restored and advanced over the kept tokens only.
  std::vector<int64_t> verify(const std::vector<int64_t>& draft);
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens);   // no EOS stop
  // Runs a short prompt and a decode step outside the session (weights paged in, scratch buffers sized), leaving the
  // session and the sampler's stream as they were and registering nothing in the prefix cache (which loses a block
  // only when the pool has no free one); returns the milliseconds it took.
  double warmup();
  void reset();            // ends the session and clears the prefix cache
  int64_t session_length() const;
  int64_t session_cached_tokens() const;   // of the session's prompt, found in the prefix cache
  int64_t num_state_snapshots() const { return snapshots_.size(); }

  // --- for the batch core (callers hold lock()) -------------------------------------------------
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(mutex_); }
  KvPool& pool() { return pool_; }
  void validate_prompt(const std::vector<int64_t>& prompt, int64_t max_new_tokens) const;
  void start(Sequence& seq);   // claims the cached prefix of a fresh sequence
  // Run chunks of `n[i]` tokens of seqs[i] (blocks already grown); returns logits of those reaching their end
  // (of every row of a chunk with proposals, `Sequence::drafted`, whose blocks are registered only once verified).
  // A hybrid model's prompt chunk that passes one of its snapshot points stops there first, in a forward of its
  // own, and the state there is kept.
  at::Tensor run(const std::vector<Sequence*>& seqs, const std::vector<int64_t>& n);
  void finish(Sequence& seq);  // registers its full blocks and releases them (and its state slot)
  // Speculation on a hybrid model: a copy of seq's recurrent state before a verify chunk (-1: not hybrid), and
  // after it either dropped (every proposal kept) or put back and advanced over the `count` tokens from the
  // sequence's computed count on (the last token and the kept proposals).
  int64_t checkpoint_state(const Sequence& seq);
  void drop_checkpoint(int64_t saved);
  void rewind_state(Sequence& seq, int64_t saved, int64_t count);

 private:
  int64_t sample_session(const at::Tensor& logits);
  bool keeps_states() const { return model_.config().hybrid && pool_.prefix_caching(); }
  // One forward over the chunks; the sequences' computed counts advanced and their full blocks registered.
  at::Tensor forward_chunks(const std::vector<Sequence*>& seqs, const std::vector<int64_t>& n);
  // A prompt's positions whose recurrent state is kept: its last block boundary, and its end when that is one.
  std::vector<int64_t> snapshot_points(const Sequence& seq) const;
  // Whether seq's computed tokens end on a block boundary whose blocks are registered in the prefix cache.
  bool at_registered_boundary(const Sequence& seq) const;
  // The state after seq's computed tokens, under their block prefix (nothing where they do not end at a
  // registered boundary, or it is kept already).
  void keep_state(const Sequence& seq);
  // After a decoding step: at a block boundary that step ended on, its state kept in place of the sequence's
  // previous decode-time one (so the next turn of a chat resumes after most of the answer, not the prompt).
  void keep_decode_state(Sequence& seq);

  QwenEngineOptions options_;
  QwenModel model_;
  KvPool pool_;
  int64_t max_model_len_ = 0;
  std::vector<int64_t> eos_;
  std::string eos_source_;
  std::mutex mutex_;
  std::unique_ptr<Sequence> session_;
  StateSnapshots snapshots_;
};

// The config of a checkpoint directory (config.json) or a .gguf file (its metadata), read before any weight; a
// refusal names the unsupported feature.
QwenConfig checkpoint_config(const std::string& checkpoint);

}  // namespace pocket
