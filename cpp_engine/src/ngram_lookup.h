// Prompt lookup for speculative decoding: the tokens that followed the latest earlier occurrence of the sequence's
// last n tokens (n from max_n down to min_n, the longest match first), as the Torch plane's n-gram proposer finds.
#pragma once

#include <cstdint>
#include <vector>

namespace pocket {

struct NgramOptions {
  int64_t num_tokens = 0;   // most tokens proposed a step (0: no speculation)
  int64_t min_n = 1, max_n = 4;
};

// Throws std::invalid_argument for counts below 1 or min_n > max_n (num_tokens 0 is allowed: off).
void validate_ngram(const NgramOptions& options);
// Up to `limit` proposed next tokens of `tokens`; empty when no n-gram of the tail recurs earlier.
std::vector<int64_t> ngram_proposal(const std::vector<int64_t>& tokens, const NgramOptions& options, int64_t limit);

}  // namespace pocket
