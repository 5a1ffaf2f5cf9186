// The sampler (sampler.h).
#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace pocket {

void validate_sampling(const SamplingOptions& o) {
  if (!(o.temperature >= 0.0) || !std::isfinite(o.temperature)) throw std::invalid_argument("temperature must be >= 0");
  if (!(o.top_p > 0.0 && o.top_p <= 1.0)) throw std::invalid_argument("top_p must be in (0, 1]");
  if (o.top_k < 0) throw std::invalid_argument("top_k must be >= 0 (0: no limit)");
  if (o.max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
  if (o.logprobs > 20) throw std::invalid_argument("logprobs must be at most 20");
  if (!(o.min_p >= 0.0 && o.min_p <= 1.0)) throw std::invalid_argument("min_p must be in [0, 1]");
  if (!(o.repetition_penalty > 0.0) || !std::isfinite(o.repetition_penalty))
    throw std::invalid_argument("repetition_penalty must be > 0");
  if (!std::isfinite(o.frequency_penalty) || !std::isfinite(o.presence_penalty))
    throw std::invalid_argument("frequency_penalty and presence_penalty must be finite");
  for (const auto& [token, bias] : o.logit_bias)
    if (!std::isfinite(bias)) throw std::invalid_argument("logit_bias values must be finite");
}

bool needs_processing(const SamplingOptions& o) {
  return !o.logit_bias.empty() || o.repetition_penalty != 1.0 || o.frequency_penalty != 0.0 ||
         o.presence_penalty != 0.0;
}

std::vector<float> process_logits(const float* logits, int64_t vocab, const SamplingOptions& o,
                                  const std::vector<int64_t>& tokens, int64_t num_prompt) {
  std::vector<float> x(logits, logits + vocab);
  for (const auto& [token, bias] : o.logit_bias)
    if (token >= 0 && token < vocab) x[token] += static_cast<float>(bias);
  if (o.repetition_penalty != 1.0) {
    std::vector<char> seen(vocab, 0);
    const float penalty = static_cast<float>(o.repetition_penalty);
    for (int64_t t : tokens) {
      if (t < 0 || t >= vocab || seen[t]) continue;
      seen[t] = 1;
      x[t] = x[t] > 0 ? x[t] / penalty : x[t] * penalty;
    }
  }
  if (o.frequency_penalty != 0.0 || o.presence_penalty != 0.0) {
    std::vector<int64_t> counts(vocab, 0);
    for (size_t i = static_cast<size_t>(num_prompt); i < tokens.size(); ++i)
      if (tokens[i] >= 0 && tokens[i] < vocab) ++counts[tokens[i]];
    for (int64_t t = 0; t < vocab; ++t)
      if (counts[t] > 0)
        x[t] -= static_cast<float>(counts[t] * o.frequency_penalty + o.presence_penalty);
  }
  return x;
}

TokenLogprobs token_logprobs(const float* logits, int64_t vocab, int64_t token, int64_t top) {
  const double best = *std::max_element(logits, logits + vocab);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += std::exp(static_cast<double>(logits[i]) - best);
  const double lse = best + std::log(total);
  TokenLogprobs out;
  out.logprob = logits[token] - lse;
  top = std::min(top, vocab);
  if (top > 0) {
    std::vector<int64_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int64_t a, int64_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < top; ++i) {
      out.top_ids.push_back(order[i]);
      out.top_logprobs.push_back(logits[order[i]] - lse);
    }
  }
  return out;
}

int64_t sample_token(const float* logits, int64_t vocab, const SamplingOptions& o, std::mt19937_64& rng) {
  if (o.temperature <= 0.0 || o.top_k == 1)   // the first maximum, as argmax picks it
    return std::max_element(logits, logits + vocab) - logits;
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = o.top_k > 0 ? std::min(o.top_k, vocab) : vocab;
  auto higher = [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (keep < vocab) std::partial_sort(order.begin(), order.begin() + keep, order.end(), higher);
  else std::sort(order.begin(), order.end(), higher);
  order.resize(keep);
  const double top = logits[order[0]];
  std::vector<double> probs(keep);
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) total += probs[i] = std::exp((logits[order[i]] - top) / o.temperature);
  if (o.min_p > 0.0) {   // probs[0] is the most likely token's (1 before normalisation)
    int64_t n = 1;
    while (n < keep && probs[n] >= o.min_p) ++n;
    probs.resize(n);
    keep = n;
    total = std::accumulate(probs.begin(), probs.end(), 0.0);
  }
  if (o.top_p < 1.0) {   // the smallest head whose mass reaches top_p
    double mass = 0.0;
    int64_t n = 0;
    while (n < keep) {
      mass += probs[n++] / total;
      if (mass >= o.top_p) break;
    }
    probs.resize(n);
    total = std::accumulate(probs.begin(), probs.end(), 0.0);
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double u = uniform(rng);
  for (size_t i = 0; i < probs.size(); ++i) {
    if (u < probs[i]) return order[i];
    u -= probs[i];
  }
  return order[probs.size() - 1];
}

}  // namespace pocket
