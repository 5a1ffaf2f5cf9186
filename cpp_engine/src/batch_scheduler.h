// QwenBatchScheduler: a BatchCore stepped on a background thread. Requests are submitted from any thread;
// tokens and results go to callbacks (on that thread) or wait to be polled. Adds and cancels are applied
// between steps. The engine must outlive the scheduler.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "batch_core.h"

namespace pocket {

struct BatchResult {
  std::string request_id;
  std::vector<int64_t> tokens;     // generated tokens, an EOS excluded
  std::string finish_reason;       // "stop", "length", "cancelled" or "error"
  std::string error;               // what went wrong, for "error"
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

struct EngineCaps {
  int64_t max_slots = 0;
  bool continuous_batching = true, chunked_prefill = true, paged_kv = true, prefix_caching = true;
  bool per_request_sampling = true, per_request_top_k = true;
  std::vector<std::string> speculative;   // the methods on: "ngram" (prompt lookup) once set
};

using TokenCallback = std::function<void(const std::string&, int64_t)>;
using ResultCallback = std::function<void(const BatchResult&)>;

class QwenBatchScheduler {
 public:
  QwenBatchScheduler(QwenEngine& engine, int64_t max_batch_size);
  ~QwenBatchScheduler();

  std::string submit(const std::vector<int64_t>& prompt, const SamplingOptions& sampling, ResultCallback on_done,
                     TokenCallback on_token);
  // The result once finished (within timeout_ms; <0 waits forever); nullopt on timeout. Without a completion
  // callback a result is kept until polled once.
  std::optional<BatchResult> poll(const std::string& id, int64_t timeout_ms);
  bool cancel(const std::string& id);   // true when the request is queued or running
  void set_prefill_token_budget(int64_t tokens);
  // Prompt-lookup speculation (BatchCore::set_ngram_speculation), from the next step on.
  void set_ngram_speculation(const NgramOptions& options);
  EngineCaps caps() const;
  int64_t max_batch_size() const { return core_.max_slots(); }
  BatchStats stats();
  void stop();   // cancels what remains and joins the thread; idempotent

 private:
  struct Pending {
    std::vector<int64_t> prompt;
    SamplingOptions sampling;
    ResultCallback on_done;
    TokenCallback on_token;
    BatchResult result;
    bool done = false;
    bool added = false;
  };
  void loop();
  void deliver(const std::vector<BatchEvent>& events);

  QwenEngine& engine_;
  BatchCore core_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::map<std::string, Pending> requests_;
  std::vector<std::string> to_add_, to_cancel_;
  int64_t budget_ = -1;
  std::optional<NgramOptions> ngram_pending_;
  std::atomic<int64_t> ngram_tokens_{0};   // read by caps() without the lock
  uint64_t counter_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pocket
