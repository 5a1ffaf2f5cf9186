// BatchCore (batch_core.h).
#include "batch_core.h"

#include <algorithm>
#include <stdexcept>

namespace pocket {

BatchCore::BatchCore(QwenEngine& engine, int64_t max_slots)
    : engine_(engine), max_slots_(std::min(max_slots, engine.options().max_slots)) {
  if (max_slots < 1) throw std::invalid_argument("max_batch_size must be >= 1");
}

void BatchCore::add(const std::string& id, const std::vector<int64_t>& prompt, const SamplingOptions& sampling) {
  validate_sampling(sampling);
  engine_.validate_prompt(prompt, sampling.max_new_tokens);
  auto guard = engine_.lock();   // stats() may read the queues from another thread
  if (seqs_.count(id)) throw std::invalid_argument("request id '" + id + "' is already active");
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->tokens = prompt;
  seq->num_prompt = static_cast<int64_t>(prompt.size());
  seq->sampling = sampling;
  seq->rng.seed(sampling.seed >= 0 ? static_cast<uint64_t>(sampling.seed) : std::random_device{}());
  waiting_.push_back(seq.get());
  seqs_[id] = std::move(seq);
}

void BatchCore::set_prefill_token_budget(int64_t tokens) {
  if (tokens < 0) throw std::invalid_argument("the prefill token budget must be >= 0 (0: whole prompts)");
  prefill_budget_ = tokens;
}

void BatchCore::set_ngram_speculation(const NgramOptions& options) {
  validate_ngram(options);
  ngram_ = options;
}

void BatchCore::propose(Sequence& seq) {
  const int64_t size = static_cast<int64_t>(seq.tokens.size());
  // The last token and every kept proposal are followed by one more draw: all of them within the budgets.
  const int64_t room = std::min(seq.sampling.max_new_tokens - seq.num_generated, engine_.max_model_len() - size) - 1;
  std::vector<int64_t> draft = ngram_proposal(seq.tokens, ngram_, room);
  KvPool& pool = engine_.pool();   // the caller grew the table for the last token
  if (draft.empty()) return;
  int64_t k = static_cast<int64_t>(draft.size());
  if (!pool.grow(seq.table, seq.num_computed + 1 + k))
    k = static_cast<int64_t>(seq.table.size()) * pool.block_size() - seq.num_computed - 1;
  if (k <= 0) return;
  seq.tokens.insert(seq.tokens.end(), draft.begin(), draft.begin() + k);
  seq.drafted = k;
}

BatchEvent BatchCore::event(const Sequence& seq, int64_t token) const {
  BatchEvent e;
  e.request_id = seq.id;
  e.token = token;
  e.prompt_tokens = seq.num_prompt;
  e.completion_tokens = seq.num_generated;
  e.cached_tokens = seq.num_cached;
  return e;
}

BatchEvent BatchCore::end(Sequence& seq, const std::string& reason, int64_t token, bool eos) {
  BatchEvent e = event(seq, token);
  e.eos = eos;
  e.finish_reason = reason;
  engine_.finish(seq);
  running_.erase(std::remove(running_.begin(), running_.end(), &seq), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &seq), waiting_.end());
  seqs_.erase(seq.id);   // seq is gone from here on
  return e;
}

std::vector<BatchEvent> BatchCore::cancel(const std::string& id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return {};
  auto guard = engine_.lock();
  return {end(*it->second, "cancelled", -1, false)};
}

void BatchCore::preempt(Sequence& seq) {
  engine_.finish(seq);   // its computed blocks stay in the prefix cache for the recompute
  seq.num_computed = 0;
  seq.hashed = 0;
  seq.last_hash = 0;
  running_.erase(std::remove(running_.begin(), running_.end(), &seq), running_.end());
  waiting_.push_front(&seq);
  ++preemptions_;
}

std::vector<BatchEvent> BatchCore::step() {
  auto guard = engine_.lock();
  KvPool& pool = engine_.pool();
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < max_slots_) {
    Sequence* s = waiting_.front();
    if (s->table.empty()) engine_.start(*s);
    if (!pool.grow(s->table, std::min<int64_t>(s->num_computed + 1, s->tokens.size()))) {
      pool.release(s->table);
      s->num_computed = s->hashed = 0;
      break;
    }
    waiting_.pop_front();
    running_.push_back(s);
  }
  std::vector<Sequence*> batch;
  std::vector<int64_t> counts;
  int64_t budget = prefill_budget_ > 0 ? prefill_budget_ : INT64_MAX;
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* s = running_[i];
    const int64_t remaining = static_cast<int64_t>(s->tokens.size()) - s->num_computed;
    int64_t n = remaining;
    if (remaining > 1) {   // a prefill chunk, within the step's prompt budget (one token at least)
      n = std::max<int64_t>(1, std::min(remaining, budget));
      budget -= std::min(budget, n);
    }
    // Out of blocks: preempt the latest admitted others until this chunk fits, or run it smaller.
    while (!pool.grow(s->table, s->num_computed + n)) {
      Sequence* victim = running_.back();
      if (victim == s) break;
      preempt(*victim);
    }
    if (static_cast<int64_t>(s->table.size()) * pool.block_size() < s->num_computed + n)
      n = static_cast<int64_t>(s->table.size()) * pool.block_size() - s->num_computed;
    if (n <= 0) continue;   // waits for blocks (validate_prompt keeps one sequence within the cache)
    // Past the prompt only: the prompt's last token samples the first output as a plain row (and its chunk may
    // stop at a kept-state point, which a verify chunk must never do).
    if (remaining == 1 && s->num_computed >= s->num_prompt && ngram_.num_tokens > 0) {
      propose(*s);
      n += s->drafted;
    }
    batch.push_back(s);
    counts.push_back(n);
  }
  std::vector<BatchEvent> events;
  if (batch.empty()) return events;
  std::vector<int64_t> saved(batch.size(), -1);   // hybrid models: the state before a verify chunk
  for (size_t i = 0; i < batch.size(); ++i)
    if (batch[i]->drafted > 0) saved[i] = engine_.checkpoint_state(*batch[i]);
  at::Tensor logits;
  try {
    logits = engine_.run(batch, counts);
  } catch (...) {
    // Nothing of a failed step is kept: proposals come off the sequences, which stand where they stood.
    for (size_t i = 0; i < batch.size(); ++i) {
      Sequence* s = batch[i];
      if (s->drafted == 0) continue;
      s->tokens.resize(s->tokens.size() - s->drafted);
      s->num_computed = std::min<int64_t>(s->num_computed, static_cast<int64_t>(s->tokens.size()) - 1);
      s->drafted = 0;
      engine_.drop_checkpoint(saved[i]);
    }
    throw;
  }
  ++steps_;
  const float* rows = logits.data_ptr<float>();
  const int64_t vocab = logits.size(1);
  int64_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence* s = batch[i];
    if (s->drafted == 0) {
      if (s->num_computed != static_cast<int64_t>(s->tokens.size())) continue;   // a prefill chunk short of the end
      emit(*s, rows + row++ * vocab, vocab, events);
      continue;
    }
    // A verify chunk: row j scored the token before proposal j; draws are kept while they equal the proposals.
    const int64_t k = s->drafted;
    const std::vector<int64_t> draft(s->tokens.end() - k, s->tokens.end());
    s->tokens.resize(s->tokens.size() - k);
    s->drafted = 0;
    const int64_t base = s->num_computed - k - 1;
    const int64_t first = row;
    row += k + 1;
    ++verify_chunks_;
    proposed_ += k;
    int64_t kept = 0;
    bool ended = false;
    for (int64_t j = 0; j <= k; ++j) {
      s->num_computed = base + 1 + j;   // the rows' inputs so far are the sequence's tokens
      ended = emit(*s, rows + (first + j) * vocab, vocab, events);
      if (ended || j == k || events.back().token != draft[j]) break;
      ++kept;
    }
    accepted_ += kept;
    if (!ended && saved[i] >= 0 && kept < k) {
      engine_.rewind_state(*s, saved[i], kept + 1);
    } else {
      engine_.drop_checkpoint(saved[i]);
    }
  }
  return events;
}

bool BatchCore::emit(Sequence& seq, const float* logits, int64_t vocab, std::vector<BatchEvent>& events) {
  std::vector<float> processed;
  if (needs_processing(seq.sampling))
    processed = process_logits(logits, vocab, seq.sampling, seq.tokens, seq.num_prompt);
  const int64_t token = sample_token(processed.empty() ? logits : processed.data(), vocab, seq.sampling, seq.rng);
  seq.tokens.push_back(token);
  ++seq.num_generated;
  const auto& eos = engine_.eos_token_ids();
  const auto& stops = seq.sampling.stop_token_ids;
  const bool stop = std::find(stops.begin(), stops.end(), token) != stops.end() ||
                    (!seq.sampling.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end());
  const int64_t asked = seq.sampling.logprobs;
  TokenLogprobs lp;
  if (asked >= 0) lp = token_logprobs(logits, vocab, token, asked);
  BatchEvent e;
  bool ended = true;
  if (stop) {
    e = end(seq, "stop", token, true);
  } else if (seq.num_generated >= seq.sampling.max_new_tokens ||
             static_cast<int64_t>(seq.tokens.size()) >= engine_.max_model_len()) {
    e = end(seq, "length", token, false);
  } else {
    e = event(seq, token);
    ended = false;
  }
  if (asked >= 0) {
    e.has_logprobs = true;
    e.logprobs = std::move(lp);
  }
  events.push_back(std::move(e));
  return ended;
}

BatchStats BatchCore::stats() {
  auto guard = engine_.lock();
  BatchStats st;
  st.running = static_cast<int64_t>(running_.size());
  st.waiting = static_cast<int64_t>(waiting_.size());
  st.free_blocks = engine_.pool().num_available();
  st.total_blocks = engine_.pool().num_blocks();
  st.prefix_queries = engine_.pool().prefix_queries();
  st.prefix_hits = engine_.pool().prefix_hits();
  st.preemptions = preemptions_;
  st.steps = steps_;
  st.verify_chunks = verify_chunks_;
  st.proposed_tokens = proposed_;
  st.accepted_tokens = accepted_;
  return st;
}

}  // namespace pocket
