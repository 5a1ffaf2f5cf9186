// What the CPU kernels' sources share: the 4-bit product and the decode attention on raw buffers (so that
// decode_step.cpp runs them without a dispatcher call each), an exp for non-positive arguments, and the row
// operations of a decode step (also the native plane's 4-bit decode layers, cpp_engine/src/q4_decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
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

// The same over a paged cache: k_cache, v_cache [slots, KVH, D] (bfloat16 or float32, heads side by side), row r
// over positions 0 .. lengths[r] - 1 of its sequence, position p held in slot slots[r][p]. A row's result is the
// one attend gives for the same values laid out in order.
void attend_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* lengths,
                  const int64_t* const* slots, float scale, at::Tensor& out);

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

// Row operations of a decode step (decode_step.cpp, and the native plane's 4-bit decode layers).

// out = x * rsqrt(mean(x^2) + eps) * w, row by row (n a multiple of 16), in torch's order of operations.
inline void rms_norm_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = _mm512_loadu_ps(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), s), _mm512_loadu_ps(w + i)));
  }
}

// a += b over n floats (n a multiple of 16).
inline void add_into(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
}

// out[r, i] = silu(gu[r, i]) * gu[r, width + i]; silu(x) = x * sigmoid(x), sigmoid from e^-|x| (width % 16 == 0).
inline void silu_mul_rows(const float* gu, int64_t rows, int64_t width, float* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * width;
    for (int64_t i = 0; i < width; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 t = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, t));
      const __m512 sig = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), inv, t);
      _mm512_storeu_ps(out + r * width + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(g + width + i)));
    }
  }
}

// Rotate-half rotary embedding of `count` heads of `dim` values: out[i] = x[i] cos[i] + x[(i + dim/2) % dim] sin[i].
// Halves of 16 or more values in vectors of 16 (SmolLM2's 64-value heads: a scalar loop with an index modulo was
// ~0.4 ms of a five-row step), the rest one value at a time.
inline void rotate_heads(const float* x, int64_t count, int64_t dim, const float* cos, const float* sin, float* out) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    const float* xh = x + h * dim;
    float* oh = out + h * dim;
    if (half % 16 == 0) {
      for (int64_t i = 0; i < dim; i += 16) {
        const int64_t j = i < half ? i + half : i - half;
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xh + i), _mm512_loadu_ps(cos + i));
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(xh + j), _mm512_loadu_ps(sin + i));
        _mm512_storeu_ps(oh + i, _mm512_add_ps(a, b));
      }
      continue;
    }
    for (int64_t i = 0; i < dim; ++i) oh[i] = xh[i] * cos[i] + xh[(i + half) % dim] * sin[i];
  }
}

}  // namespace pocketllm_cpu
