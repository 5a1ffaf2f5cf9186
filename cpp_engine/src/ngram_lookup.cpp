// Prompt lookup (ngram_lookup.h).
#include "ngram_lookup.h"

#include <algorithm>
#include <stdexcept>

namespace pocket {

void validate_ngram(const NgramOptions& o) {
  if (o.num_tokens < 0) throw std::invalid_argument("num_speculative_tokens must be >= 0");
  if (o.min_n < 1 || o.max_n < 1) throw std::invalid_argument("prompt_lookup_min and prompt_lookup_max must be >= 1");
  if (o.min_n > o.max_n) throw std::invalid_argument("prompt_lookup_min must not exceed prompt_lookup_max");
}

std::vector<int64_t> ngram_proposal(const std::vector<int64_t>& tokens, const NgramOptions& o, int64_t limit) {
  limit = std::min(limit, o.num_tokens);
  const int64_t length = static_cast<int64_t>(tokens.size());
  if (limit < 1 || length < o.min_n + 1) return {};
  const int64_t longest = std::min(o.max_n, length - 1);
  for (int64_t n = longest; n >= o.min_n; --n) {
    const int64_t* tail = tokens.data() + length - n;
    // The latest end e < length (a token follows it) with tokens[e - n, e) equal to the tail.
    for (int64_t e = length - 1; e >= n; --e)
      if (std::equal(tail, tail + n, tokens.data() + e - n))
        return std::vector<int64_t>(tokens.begin() + e, tokens.begin() + std::min(e + limit, length));
  }
  return {};
}

}  // namespace pocket
