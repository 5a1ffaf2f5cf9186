// Causal attention of a flat batch of query rows over a paged KV cache, reading each sequence's keys and values
// in place through its slot list (no gather), with grouped KV heads.
#pragma once

#include <cstdint>
#include <vector>

namespace pocket {

// One chunk of query rows: rows [row0, row0 + n) at positions [start, start + n) of a sequence whose position p
// lives in cache slot slots[p].
struct AttentionChunk {
  int64_t row0 = 0, start = 0, n = 0;
  const int64_t* slots = nullptr;
};

// q, out [rows, H, D]; k_cache, v_cache [slots, KVH, D]; all float32 and contiguous.
void paged_attention(const float* q, const float* k_cache, const float* v_cache, float* out,
                     const std::vector<AttentionChunk>& chunks, int64_t H, int64_t KVH, int64_t D, float scale);

}  // namespace pocket
