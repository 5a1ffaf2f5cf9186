// Causal attention of a flat batch of query rows over a paged KV cache, reading each sequence's keys and values
// in place through its slot list (no gather), with grouped KV heads.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pocket {

// One chunk of query rows: rows [row0, row0 + n) at positions [start, start + n) of a sequence whose position p
// lives in cache slot slots[p]; its slot list starts at `offset` in the forward's flat list of every chunk's slots.
struct AttentionChunk {
  int64_t row0 = 0, start = 0, n = 0;
  const int64_t* slots = nullptr;
  int64_t offset = 0;
};

// q, out [rows, H, D]; k_cache, v_cache [slots, KVH, D]; all float32 and contiguous. On a CPU with the project's
// AVX-512 kernels and a head shape they take, the project's decode attention (pocketllm/kernels/cpu/
// decode_attention.cpp, over the slots in place: paged_attention_avx512), else a portable loop; either way a row's
// result depends on its own query, context and the thread count only, not on the rows beside it.
void paged_attention(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, float* out,
                     const std::vector<AttentionChunk>& chunks, int64_t H, int64_t KVH, int64_t D, float scale);

// The project's kernel: whether it takes these heads on this CPU (paged_attention.cpp, built without AVX-512
// flags), and `rows` query rows through it (paged_attention_avx512.cpp, built with them): row r of q and out
// ([rows, H, D]) over positions 0 .. lengths[r] - 1 held in slots slots[r][p].
bool paged_attention_avx512_supported(int64_t H, int64_t KVH, int64_t D);
void paged_attention_avx512(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, float* out,
                            const int64_t* lengths, const int64_t* const* slots, int64_t rows, int64_t H,
                            int64_t KVH, int64_t D, float scale);

// The same attention as ATen operations on the tensors' device (a CUDA device, or the CPU for its tests): q and
// out [rows, H, D], the caches [slots, KVH, D], `context_slots` (int64, on the same device) every chunk's slot list
// back to back. Per chunk its context is gathered once and every row attends causally over it.
void paged_attention_aten(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& out, const std::vector<AttentionChunk>& chunks,
                          const at::Tensor& context_slots, float scale);

}  // namespace pocket
