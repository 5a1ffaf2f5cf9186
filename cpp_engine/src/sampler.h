// Token choice from one row of logits: greedy (temperature 0), or a seeded draw after temperature, top-k, top-p.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace pocket {

struct SamplingOptions {
  double temperature = 0.0;   // 0: greedy
  double top_p = 1.0;
  int64_t top_k = 0;          // 0: every token
  int64_t seed = -1;          // < 0: from the system's entropy
  int64_t max_new_tokens = 16;
  bool ignore_eos = false;
  std::vector<int64_t> stop_token_ids;
};

// Throws std::invalid_argument for options out of range.
void validate_sampling(const SamplingOptions& options);

int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options, std::mt19937_64& rng);

}  // namespace pocket
