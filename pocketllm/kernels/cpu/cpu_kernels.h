// What the CPU kernels' sources share: the 4-bit product and the decode attention on raw buffers (so that
// decode_step.cpp runs them without a dispatcher call each), and an exp for non-positive arguments.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

namespace pocketllm_cpu {

constexpr int64_t kTile = 16;     // output channels per q4 record
constexpr int64_t kBlock = 32;    // inputs per q4 record (and per activation scale)
constexpr int64_t kRecord = 320;  // bytes per q4 record

// Room the 4-bit product needs for its quantised activations: rows x k codes, then 2 x rows x (k / 32) floats.
inline int64_t q4_scratch_bytes(int64_t rows, int64_t k) { return rows * k + 8 * rows * (k / kBlock); }

// out [rows, N] = x [rows, k] @ W.T for W the records [N / 16, k / 32, 320]; scratch of q4_scratch_bytes.
void q4_matmul(const float* x, int64_t rows, const at::Tensor& records, float* out, uint8_t* scratch);

// Decode attention (decode_attention.cpp's header): q [R, KVH, G, D] float32 over k, v [S, L, KVH, D] bfloat16 or
// float32, row r over sequence seqs[r] of k and v (seqs null: sequence r) to its positions starts[r] ..
// lengths[r] - 1 (starts null: from 0); out [R, KVH, G, D] float32, contiguous. Each row's result depends on its
// own query, sequence, length and start only (not on the other rows).
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lengths,
            const int64_t* starts, float scale, at::Tensor& out, const int64_t* seqs = nullptr);

// Each of `rows` rows of `logits` [rows, n]: its `count` highest replaced by the float32 dot products of the row's
// x [rows, h] (h a multiple of 16) with those rows of `weight` (float32, rows `w_stride` apart); lm_head_rescore.cpp.
void rescore_top_rows(float* logits, int64_t rows, int64_t n, const float* x, int64_t h, const float* weight,
                      int64_t w_stride, int64_t count);

// e^x for x <= 0 (scores minus their maximum): 2^n * 2^f, 2^f by its Taylor polynomial on [-0.5, 0.5] (relative
// error ~2e-7); below -87 the result is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512 r = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ), r);
}

}  // namespace pocketllm_cpu
