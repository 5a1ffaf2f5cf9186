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
  int64_t logprobs = -1;      // >= 0: the chosen token's log-probability and this many top alternatives
  double min_p = 0.0;         // sampling: drop tokens less likely than min_p times the most likely one
  double repetition_penalty = 1.0;   // over prompt and output tokens: positive logits divided, others multiplied
  double frequency_penalty = 0.0;    // minus count x this, over output tokens
  double presence_penalty = 0.0;     // minus this for every token present in the output
  std::vector<std::pair<int64_t, double>> logit_bias;   // added to the logits (ids outside the vocabulary ignored)
};

// Whether the logits need `process_logits` before the choice.
bool needs_processing(const SamplingOptions& options);
// Apply, in order, logit_bias, the repetition penalty over prompt + output tokens, then the frequency and
// presence penalties over the output tokens (tokens[num_prompt:]), to a copy of one row of logits.
std::vector<float> process_logits(const float* logits, int64_t vocab, const SamplingOptions& options,
                                  const std::vector<int64_t>& tokens, int64_t num_prompt);

// Log-probabilities under the raw distribution of one row of logits: the chosen token's, and the `top` most
// likely tokens' (most likely first; ties by lower id).
struct TokenLogprobs {
  double logprob = 0.0;
  std::vector<int64_t> top_ids;
  std::vector<double> top_logprobs;
};
TokenLogprobs token_logprobs(const float* logits, int64_t vocab, int64_t token, int64_t top);

// Throws std::invalid_argument for options out of range.
void validate_sampling(const SamplingOptions& options);

int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& options, std::mt19937_64& rng);

}  // namespace pocket
