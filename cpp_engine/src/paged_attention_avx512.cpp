// The paged attention through the project's decode attention kernel (pocketllm/kernels/cpu/decode_attention.cpp,
// compiled into this plane without its op registration), reading each row's keys and values at its slots in place.
// Built with the AVX-512 flags: only raw arrays come in (the rows are gathered by paged_attention.cpp).
#include "cpu_kernels.h"
#include "paged_attention.h"

namespace pocket {

void paged_attention_avx512(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, float* out,
                            const int64_t* lengths, const int64_t* const* slots, int64_t rows, int64_t H,
                            int64_t KVH, int64_t D, float scale) {
  if (rows == 0) return;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor qt = at::from_blob(const_cast<float*>(q), {rows, KVH, H / KVH, D}, f32);
  at::Tensor ot = at::from_blob(out, {rows, KVH, H / KVH, D}, f32);
  pocketllm_cpu::attend_paged(qt, k_cache, v_cache, lengths, slots, scale, ot);
}

}  // namespace pocket
