// QwenBatchScheduler (batch_scheduler.h).
#include "batch_scheduler.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <stdexcept>

namespace pocket {

QwenBatchScheduler::QwenBatchScheduler(QwenEngine& engine, int64_t max_batch_size)
    : engine_(engine), core_(engine, max_batch_size) {
  thread_ = std::thread([this] { loop(); });
}

QwenBatchScheduler::~QwenBatchScheduler() { stop(); }

std::string QwenBatchScheduler::submit(const std::vector<int64_t>& prompt, const SamplingOptions& sampling,
                                       ResultCallback on_done, TokenCallback on_token) {
  validate_sampling(sampling);
  engine_.validate_prompt(prompt, sampling.max_new_tokens);
  std::lock_guard<std::mutex> guard(mutex_);
  if (stopping_) throw std::runtime_error("the scheduler has been stopped");
  const std::string id = "native-" + std::to_string(++counter_);
  Pending& p = requests_[id];
  p.prompt = prompt;
  p.sampling = sampling;
  p.on_done = std::move(on_done);
  p.on_token = std::move(on_token);
  p.result.request_id = id;
  to_add_.push_back(id);
  wake_.notify_all();
  return id;
}

std::optional<BatchResult> QwenBatchScheduler::poll(const std::string& id, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw std::invalid_argument("unknown or already polled request id '" + id + "'");
  auto ready = [&] { return it->second.done; };
  if (timeout_ms < 0) finished_.wait(lock, ready);
  else if (!finished_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready)) return std::nullopt;
  BatchResult r = it->second.result;
  requests_.erase(it);
  return r;
}

bool QwenBatchScheduler::cancel(const std::string& id) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second.done) return false;
  to_cancel_.push_back(id);
  wake_.notify_all();
  return true;
}

void QwenBatchScheduler::set_prefill_token_budget(int64_t tokens) {
  if (tokens < 0) throw std::invalid_argument("the prefill token budget must be >= 0 (0: whole prompts)");
  std::lock_guard<std::mutex> guard(mutex_);
  budget_ = tokens;
  wake_.notify_all();
}

void QwenBatchScheduler::set_ngram_speculation(const NgramOptions& options) {
  validate_ngram(options);
  std::lock_guard<std::mutex> guard(mutex_);
  ngram_pending_ = options;
  ngram_tokens_ = options.num_tokens;
  wake_.notify_all();
}

EngineCaps QwenBatchScheduler::caps() const {
  EngineCaps c;
  c.max_slots = engine_.options().max_slots;
  c.prefix_caching = engine_.options().prefix_caching;
  if (ngram_tokens_ > 0) c.speculative.push_back("ngram");
  return c;
}

BatchStats QwenBatchScheduler::stats() { return core_.stats(); }

void QwenBatchScheduler::deliver(const std::vector<BatchEvent>& events) {
  for (const BatchEvent& e : events) {
    ResultCallback on_done;
    TokenCallback on_token;
    BatchResult result;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = requests_.find(e.request_id);
      if (it == requests_.end()) continue;
      Pending& p = it->second;
      if (e.token >= 0 && !e.eos) p.result.tokens.push_back(e.token);
      on_token = p.on_token;
      if (!e.finish_reason.empty()) {
        p.result.finish_reason = e.finish_reason;
        p.result.prompt_tokens = e.prompt_tokens;
        p.result.completion_tokens = e.completion_tokens;
        p.result.cached_tokens = e.cached_tokens;
        result = p.result;
        on_done = p.on_done;
        if (on_done) requests_.erase(it);   // delivered by the callback: nothing to poll
        else p.done = true;
      }
    }
    // Callbacks run without the lock: they may submit or cancel. The bindings catch what they raise.
    if (on_token && e.token >= 0 && !e.eos) on_token(e.request_id, e.token);
    if (!e.finish_reason.empty()) {
      if (on_done) on_done(result);
      else finished_.notify_all();
    }
  }
}

void QwenBatchScheduler::loop() {
  while (true) {
    std::vector<std::string> adds, cancels;
    std::vector<std::pair<std::string, Pending*>> new_requests;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !to_add_.empty() || !to_cancel_.empty() || core_.has_work(); });
      stopping = stopping_;
      adds.swap(to_add_);
      cancels.swap(to_cancel_);
      if (budget_ >= 0) {
        core_.set_prefill_token_budget(budget_);
        budget_ = -1;
      }
      if (ngram_pending_) {
        core_.set_ngram_speculation(*ngram_pending_);
        ngram_pending_.reset();
      }
      for (const auto& id : adds) new_requests.emplace_back(id, &requests_.at(id));
    }
    std::vector<BatchEvent> events;
    for (auto& [id, p] : new_requests) {
      try {
        core_.add(id, p->prompt, p->sampling);
      } catch (const std::exception& err) {
        BatchEvent e;
        e.request_id = id;
        e.finish_reason = "error";
        events.push_back(e);
        std::lock_guard<std::mutex> guard(mutex_);
        p->result.error = err.what();
      }
    }
    for (const auto& id : cancels) {
      auto ended = core_.cancel(id);
      events.insert(events.end(), ended.begin(), ended.end());
    }
    if (stopping) {
      std::vector<std::string> remaining;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        for (const auto& [id, p] : requests_)
          if (!p.done) remaining.push_back(id);
      }
      for (const auto& id : remaining) {
        auto ended = core_.cancel(id);
        events.insert(events.end(), ended.begin(), ended.end());
      }
      deliver(events);
      return;
    }
    deliver(events);
    if (!core_.has_work()) continue;
    try {
      deliver(core_.step());
    } catch (const std::exception& err) {
      std::fprintf(stderr, "pocketllm_cpp: a scheduler step failed: %s\n", err.what());
      std::vector<std::string> running;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        for (auto& [id, p] : requests_)
          if (!p.done) { running.push_back(id); p.result.error = err.what(); }
      }
      std::vector<BatchEvent> failed;
      for (const auto& id : running) {
        for (BatchEvent e : core_.cancel(id)) { e.finish_reason = "error"; failed.push_back(e); }
      }
      deliver(failed);
    }
  }
}

void QwenBatchScheduler::stop() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
    wake_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace pocket
