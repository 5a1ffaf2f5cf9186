// Continuous batching over a QwenEngine, stepped by its caller: requests wait, are admitted up to the slot
// limit (their cached prefix claimed), and every step runs each running sequence's next chunk (a decode token
// or a prefill chunk within the prefill token budget) in one forward. Out of blocks, the latest admitted
// sequence is preempted and later recomputed.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "ngram_lookup.h"
#include "qwen_engine.h"

namespace pocket {

// One request's outcome of a step: a sampled token (-1: none) and, when it ended, why.
struct BatchEvent {
  std::string request_id;
  int64_t token = -1;
  bool eos = false;               // the token is an EOS or stop token: it ends the request and is not output
  std::string finish_reason;      // "" (running), "stop", "length" or "cancelled"
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // sampled tokens, an EOS included
  int64_t cached_tokens = 0;
  bool has_logprobs = false;      // the request asked for log-probabilities (SamplingOptions::logprobs >= 0)
  TokenLogprobs logprobs;
};

struct BatchStats {
  int64_t running = 0, waiting = 0, free_blocks = 0, total_blocks = 0, prefix_queries = 0, prefix_hits = 0;
  int64_t preemptions = 0, steps = 0;
  int64_t verify_chunks = 0, proposed_tokens = 0, accepted_tokens = 0;   // speculation
};

class BatchCore {
 public:
  BatchCore(QwenEngine& engine, int64_t max_slots);

  int64_t max_slots() const { return max_slots_; }
  // Queue a request; throws std::invalid_argument for a bad prompt, options or a duplicate id.
  void add(const std::string& id, const std::vector<int64_t>& prompt, const SamplingOptions& sampling);
  // End a request now; its "cancelled" event is returned (none when unknown or finished).
  std::vector<BatchEvent> cancel(const std::string& id);
  std::vector<BatchEvent> step();
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  bool active(const std::string& id) const { return seqs_.count(id) > 0; }
  void set_prefill_token_budget(int64_t tokens);
  // Speculative decoding by prompt lookup: a decoding sequence whose tail recurs earlier runs the tokens that
  // followed it as proposals in its chunk; each row's draw is kept while it equals the proposal before it, so the
  // tokens are those plain decode steps give under the same random stream. num_tokens 0 turns it off.
  void set_ngram_speculation(const NgramOptions& options);
  const NgramOptions& ngram_speculation() const { return ngram_; }
  int64_t prefill_token_budget() const { return prefill_budget_; }
  BatchStats stats();

 private:
  BatchEvent end(Sequence& seq, const std::string& reason, int64_t token, bool eos);
  BatchEvent event(const Sequence& seq, int64_t token) const;
  // Sample seq's next token from `logits`, append it and its event (ending the sequence on a stop token, its token
  // budget or the context); true when it ended (seq is gone then).
  bool emit(Sequence& seq, const float* logits, int64_t vocab, std::vector<BatchEvent>& events);
  // Up to `room` proposals appended to a decoding sequence (its blocks grown for them, never by preempting).
  void propose(Sequence& seq);
  void preempt(Sequence& seq);

  QwenEngine& engine_;
  int64_t max_slots_;
  int64_t prefill_budget_ = 512;
  std::unordered_map<std::string, std::unique_ptr<Sequence>> seqs_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  int64_t preemptions_ = 0, steps_ = 0;
  NgramOptions ngram_;
  int64_t verify_chunks_ = 0, proposed_ = 0, accepted_ = 0;
};

}  // namespace pocket
