// x @ W.T on CPU with W in 4-bit blocks (a code 0..15, an fp16 scale d and minimum m per 32 inputs: w = d*q + m,
// GGUF's Q4_1) and x quantised per row and block of 32 inputs to 8 bits (llama.cpp's Q8_1 activations), the dot
// products in AVX-512 VNNI (u8 x s8 -> s32). Built at run time by pocketllm/kernels/cpu_native.py.
//
// Weights are records of 320 bytes, one per (tile of 16 output channels, block of 32 inputs), tile-major:
//   bytes 0..255: four chunks j of 64 bytes; byte 4*lane + i of chunk j holds, for channel 16*tile + lane,
//                 input 32*block + 8*j + i in its low nibble and input 32*block + 8*j + 4 + i in its high one;
//   bytes 256..287: the 16 channels' d (fp16), bytes 288..319: their m (fp16).
// So one 64-byte load holds 16 channels x 8 inputs, and each 32-bit lane of a VNNI dot product is one channel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifndef POCKETLLM_NO_TORCH_OPS
#include <torch/library.h>
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace pocketllm_cpu {
namespace {

constexpr int kMaxRows = 8;       // rows one pass over the weights carries

// One row's activations: int8 codes q = round(x * 127 / amax) per block of 32, the block's scale d = amax / 127
// and d * sum(q) (which multiplies the weights' minimum m).
void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock);
    const __m512 hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    d[b] = amax / 127.f;
    s[b] = d[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [0, M) of the output for one tile of 16 channels: M accumulators in registers, the tile's weights read
// once. (Measured on two cores: several tiles at once, software prefetch, or more sums per row to shorten the
// chain of dot products were all as fast or slower.)
template <int M>
void tile_rows(const uint8_t* weights, int64_t blocks, const int8_t* xq, const float* xd, const float* xs,
               float* out, int64_t n_out, int64_t tile) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  const int64_t k = blocks * kBlock;
  const uint8_t* rec = weights + tile * blocks * kRecord;
  for (int64_t b = 0; b < blocks; ++b, rec += kRecord) {
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * j);
      const __m512i low = _mm512_and_si512(v, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int m = 0; m < M; ++m) {
        const int8_t* xk = xq + m * k + b * kBlock + 8 * j;
        dot[m] = _mm512_dpbusd_epi32(dot[m], low, broadcast4(xk));
        dot[m] = _mm512_dpbusd_epi32(dot[m], high, broadcast4(xk + 4));
      }
    }
    const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    for (int m = 0; m < M; ++m) {
      const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(xd[m * blocks + b]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), scale, total[m]);
      total[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[m * blocks + b]), total[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * n_out + tile * kTile, total[m]);
}

template <int M>
void tile_range(const uint8_t* w, int64_t blocks, const int8_t* xq, const float* xd, const float* xs, float* out,
                int64_t n_out, int64_t begin, int64_t end) {
  for (int64_t tile = begin; tile < end; ++tile) tile_rows<M>(w, blocks, xq, xd, xs, out, n_out, tile);
}

void rows_pass(int rows, const uint8_t* w, int64_t blocks, const int8_t* xq, const float* xd, const float* xs,
               float* out, int64_t n_out, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return tile_range<1>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 2: return tile_range<2>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 3: return tile_range<3>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 4: return tile_range<4>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 5: return tile_range<5>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 6: return tile_range<6>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    case 7: return tile_range<7>(w, blocks, xq, xd, xs, out, n_out, begin, end);
    default: return tile_range<8>(w, blocks, xq, xd, xs, out, n_out, begin, end);
  }
}

}  // namespace

void q4_matmul(const float* x, int64_t rows, const at::Tensor& records, float* out, uint8_t* scratch) {
  const int64_t tiles_n = records.size(0), blocks = records.size(1), out_features = tiles_n * kTile;
  const int64_t k = blocks * kBlock;
  int8_t* qp = reinterpret_cast<int8_t*>(scratch);
  float* dp = reinterpret_cast<float*>(scratch + rows * k);
  float* sp = dp + rows * blocks;
  for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * k, blocks, qp + r * k, dp + r * blocks, sp + r * blocks);
  const uint8_t* wp = records.data_ptr<uint8_t>();
  at::parallel_for(0, tiles_n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
      rows_pass(n, wp, blocks, qp + r * k, dp + r * blocks, sp + r * blocks, out + r * out_features, out_features,
                begin, end);
    }
  });
}

#ifndef POCKETLLM_NO_TORCH_OPS   // the native plane (cpp_engine) calls q4_matmul directly and registers no ops
namespace {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weights.dim() == 3 && weights.scalar_type() == at::kByte && weights.size(2) == kRecord &&
              weights.is_contiguous(), "q4_linear: weights must be contiguous uint8 [N / 16, K / 32, 320] records");
  TORCH_CHECK(x.size(1) == weights.size(1) * kBlock, "q4_linear: shapes do not match the weight records");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  at::Tensor out = at::empty({rows, weights.size(0) * kTile}, x.options());
  if (rows == 0) return out;
  at::Tensor scratch = at::empty({q4_scratch_bytes(rows, k)}, x.options().dtype(at::kByte));
  q4_matmul(xc.data_ptr<float>(), rows, weights, out.data_ptr<float>(), scratch.data_ptr<uint8_t>());
  return out;
}

}  // namespace
#endif  // POCKETLLM_NO_TORCH_OPS
}  // namespace pocketllm_cpu

#ifndef POCKETLLM_NO_TORCH_OPS
TORCH_LIBRARY(pocketllm_cpu, m) {
  m.def("q4_linear(Tensor x, Tensor weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm_cpu, CPU, m) {
  m.impl("q4_linear", &pocketllm_cpu::q4_linear);
}
#endif  // POCKETLLM_NO_TORCH_OPS
