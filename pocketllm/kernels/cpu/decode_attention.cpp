// Decode attention on CPU: a few query rows, each over its own context of cached K/V (bfloat16 or float32), in
// AVX-512 float32 arithmetic. Built at run time with the other sources here by pocketllm/kernels/cpu_native.py.
//
// q [R, KVH, G, D] float32 (any strides, the last dimension contiguous): a KV head's G query heads; k, v [R, L, KVH, D] (any strides, the last dimension
// contiguous): row r attends to its positions starts[r] .. lengths[r] - 1 (no starts: from 0). Out [R, KVH, G, D]
// float32.
// Work is split over (row, a range of positions), so that one row still keeps both cores busy; each range keeps,
// per head, its softmax maximum, sum and unnormalised output, and a last pass merges the ranges of a head.
// attend_paged (the native plane's) reads a paged cache [slots, KVH, D] instead: row r's position p at slot
// slots[r][p], with the same arithmetic (no sliding-window starts there).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifndef POCKETLLM_NO_TORCH_OPS
#include <torch/library.h>
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace pocketllm_cpu {
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Lane i of the result is the sum of the 16 lanes of v[i], for 8 vectors (lanes 8..15 repeat 0..7): three rounds
// of pairwise shuffles and adds instead of a horizontal sum each.
inline __m512 sum_lanes8(const __m512 v[8]) {
  __m512 w[4], u[2];
  for (int j = 0; j < 4; ++j)   // 128-bit lanes (0, 1 | 0, 1) + (2, 3 | 2, 3): halves of v[2j] | v[2j+1]
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 2; ++j)   // lane pairs summed: 128-bit lane c holds 4 partial sums of one vector
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  // Within each 128-bit lane, elements (0, 2) + (1, 3) twice: element l of t is the sum of v[l / 4 + 4 * (l % 2)].
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xDD));
  return _mm512_permutexvar_ps(_mm512_set_epi32(13, 9, 5, 1, 12, 8, 4, 0, 13, 9, 5, 1, 12, 8, 4, 0), t);
}

inline void prefetch_row(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

struct Partial {   // one range of positions of one (row, KV head): per query head
  float* max;      // [G]
  float* sum;      // [G]
  float* out;      // [G, D] unnormalised
};

// Positions [p0, p1) of one (row, KV head) for its G query heads; D = 16 * DV. Prefetches `prefetch_bytes` of each
// position from k and v (a whole row's heads from the first head, when they are adjacent; none when 0).
template <typename T, int DV, int G, bool Paged>
void attend_range(const float* q, int64_t q_step, const T* k, const T* v, int64_t k_step, int64_t v_step, int64_t p0, int64_t p1,
                  float scale, std::vector<float>& scores, Partial part, size_t prefetch_bytes, const int64_t* slots) {
  constexpr int D = 16 * DV;
  // Position p's row of k and v: p itself, or (a paged cache) its slot.
  auto row_of = [slots](int64_t p) { if constexpr (Paged) return slots[p]; else return p; };
  const int64_t n = p1 - p0;
  scores.resize(static_cast<size_t>(G * n));
  __m512 qv[G][DV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_step + 16 * c), _mm512_set1_ps(scale));
  float best[G];
  for (int g = 0; g < G; ++g) best[g] = -std::numeric_limits<float>::infinity();
  __m512 top[G];
  for (int g = 0; g < G; ++g) top[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {   // eight positions at a time: their dot products summed together
    __m512 acc[G][8];
    for (int e = 0; e < 8; ++e) {
      // Short strided streams that the hardware prefetchers pick up late: ask for the keys two blocks ahead,
      // and for this block's values, which the last pass reads.
      if (prefetch_bytes > 0) {
        prefetch_row(k + row_of(p0 + std::min(i + 16 + e, n - 1)) * k_step, prefetch_bytes);
        prefetch_row(v + row_of(p0 + i + e) * v_step, prefetch_bytes);
      }
      const T* kp = k + row_of(p0 + i + e) * k_step;
      __m512 kv[DV];
      for (int c = 0; c < DV; ++c) kv[c] = load16(kp + 16 * c);
      for (int g = 0; g < G; ++g) {
        acc[g][e] = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < DV; ++c) acc[g][e] = _mm512_fmadd_ps(qv[g][c], kv[c], acc[g][e]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sums = sum_lanes8(acc[g]);
      _mm512_mask_storeu_ps(scores.data() + g * n + i, 0xFF, sums);
      top[g] = _mm512_max_ps(top[g], sums);
    }
  }
  for (int g = 0; g < G; ++g) best[g] = _mm512_reduce_max_ps(top[g]);
  for (; i < n; ++i) {
    const T* kp = k + row_of(p0 + i) * k_step;
    __m512 kv[DV];
    for (int c = 0; c < DV; ++c) kv[c] = load16(kp + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      const float s = _mm512_reduce_add_ps(acc);
      scores[g * n + i] = s;
      best[g] = std::max(best[g], s);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    __m512 total = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(best[g]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
      _mm512_storeu_ps(s + i, e);
      total = _mm512_add_ps(total, e);
    }
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), m)));
      _mm512_mask_storeu_ps(s + i, tail, e);
      total = _mm512_add_ps(total, e);
    }
    part.max[g] = best[g];
    part.sum[g] = _mm512_reduce_add_ps(total);
  }
  __m512 ov[G][DV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) ov[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* vp = v + row_of(p0 + i) * v_step;
    __m512 vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = load16(vp + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + i]);
      for (int c = 0; c < DV; ++c) ov[g][c] = _mm512_fmadd_ps(p, vv[c], ov[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(part.out + g * D + 16 * c, ov[g][c]);
}

template <typename T, int DV, int G>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lengths,
                const int64_t* starts, float scale, at::Tensor& out, const int64_t* seqs, const int64_t* const* slots) {
  constexpr int D = 16 * DV;
  const int64_t rows = q.size(0), heads = q.size(1);
  if (rows == 0) return;
  const int64_t longest = *std::max_element(lengths, lengths + rows);
  // A task is a range of one row's positions over all its KV heads, so that the positions' K/V rows are read in
  // order (a task per head read 128 of every 384 bytes of SmolLM2's rows: 4.3 against 3.7 ms for 8 rows of 256
  // positions over 30 layers on two cores). Ranges: enough tasks for every thread twice, none shorter than 32
  // positions, none longer than 256 (their K/V stay in L2 from the first head to the last).
  // A row splits as a one-row step of its length would, whatever else the batch holds, so that its result is the
  // same bit for bit in any batch (a speculative verify step's rows equal the decode steps they stand for); the
  // task grid has the longest row's splits, and the tasks past a row's own are empty.
  const int64_t want = 2 * at::get_num_threads();
  auto splits_of = [want](int64_t length) {
    return std::max<int64_t>({1, std::min<int64_t>(want, (length + 31) / 32), (length + 255) / 256});
  };
  const int64_t splits = splits_of(longest);
  const int64_t stride = G * (D + 2);
  std::vector<float> partials(static_cast<size_t>(rows * heads * splits * stride));
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool packed = k.stride(2) == D && v.stride(2) == D;   // a position's heads side by side
  at::parallel_for(0, rows * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / splits, s = task % splits;
      const int64_t length = lengths[r], first = starts != nullptr ? starts[r] : 0;
      const int64_t own = splits_of(length);
      const int64_t chunk = (length - first + own - 1) / own;
      const int64_t p0 = std::min(length, first + s * chunk), p1 = std::min(length, p0 + chunk);
      for (int64_t h = 0; h < heads; ++h) {
        float* base = partials.data() + ((r * heads + h) * splits + s) * stride;
        Partial part{base, base + G, base + 2 * G};
        if (p0 >= p1) {
          for (int g = 0; g < G; ++g) part.sum[g] = 0.f, part.max[g] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const int64_t seq = slots != nullptr ? 0 : seqs != nullptr ? seqs[r] : r;
        const T* kh = kp + seq * k.stride(0) + h * k.stride(2);
        const T* vh = vp + seq * v.stride(0) + h * v.stride(2);
        const size_t prefetch = packed ? (h == 0 ? heads * D * sizeof(T) : 0) : D * sizeof(T);
        const float* qh = qp + r * q.stride(0) + h * q.stride(1);
        if (slots != nullptr) {
          attend_range<T, DV, G, true>(qh, q.stride(2), kh, vh, k.stride(1), v.stride(1), p0, p1, scale, scores, part,
                                       prefetch, slots[r]);
        } else {
          attend_range<T, DV, G, false>(qh, q.stride(2), kh, vh, k.stride(1), v.stride(1), p0, p1, scale, scores,
                                        part, prefetch, nullptr);
        }
      }
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t rh = 0; rh < rows * heads; ++rh) {
    for (int g = 0; g < G; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, partials[(rh * splits + s) * stride + g]);
      float total = 0.f;
      float acc[D] = {};
      for (int64_t s = 0; s < splits; ++s) {
        const float* base = partials.data() + (rh * splits + s) * stride;
        if (base[G + g] == 0.f) continue;
        const float w = std::exp(base[g] - top);
        total += w * base[G + g];
        for (int d = 0; d < D; ++d) acc[d] += w * base[2 * G + g * D + d];
      }
      float* o = op + (rh * G + g) * D;
      for (int d = 0; d < D; ++d) o[d] = acc[d] / total;
    }
  }
}

template <typename T, int DV>
void by_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lengths,
              const int64_t* starts, float scale, at::Tensor& out, const int64_t* seqs, const int64_t* const* slots) {
  switch (group) {
    case 1: return attend_all<T, DV, 1>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 2: return attend_all<T, DV, 2>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 3: return attend_all<T, DV, 3>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 4: return attend_all<T, DV, 4>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 5: return attend_all<T, DV, 5>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 6: return attend_all<T, DV, 6>(q, k, v, lengths, starts, scale, out, seqs, slots);
    case 7: return attend_all<T, DV, 7>(q, k, v, lengths, starts, scale, out, seqs, slots);
    default: return attend_all<T, DV, 8>(q, k, v, lengths, starts, scale, out, seqs, slots);
  }
}

template <typename T>
void by_dim(int64_t dim, int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const int64_t* lengths, const int64_t* starts, float scale, at::Tensor& out, const int64_t* seqs,
            const int64_t* const* slots) {
  switch (dim) {
    case 16: return by_group<T, 1>(group, q, k, v, lengths, starts, scale, out, seqs, slots);
    case 32: return by_group<T, 2>(group, q, k, v, lengths, starts, scale, out, seqs, slots);
    case 64: return by_group<T, 4>(group, q, k, v, lengths, starts, scale, out, seqs, slots);
    default: return by_group<T, 8>(group, q, k, v, lengths, starts, scale, out, seqs, slots);
  }
}

}  // namespace

void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lengths,
            const int64_t* starts, float scale, at::Tensor& out, const int64_t* seqs) {
  const int64_t dim = q.size(3), group = q.size(2);
  if (k.scalar_type() == at::kBFloat16) {
    by_dim<at::BFloat16>(dim, group, q, k, v, lengths, starts, scale, out, seqs, nullptr);
  } else {
    by_dim<float>(dim, group, q, k, v, lengths, starts, scale, out, seqs, nullptr);
  }
}

void attend_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* lengths,
                  const int64_t* const* slots, float scale, at::Tensor& out) {
  const int64_t dim = q.size(3), group = q.size(2);
  // One "sequence" of every slot: position p of row r is slot slots[r][p].
  const at::Tensor k = k_cache.unsqueeze(0), v = v_cache.unsqueeze(0);
  if (k.scalar_type() == at::kBFloat16) {
    by_dim<at::BFloat16>(dim, group, q, k, v, lengths, nullptr, scale, out, nullptr, slots);
  } else {
    by_dim<float>(dim, group, q, k, v, lengths, nullptr, scale, out, nullptr, slots);
  }
}

#ifndef POCKETLLM_NO_TORCH_OPS   // the native plane (cpp_engine) calls attend_paged directly and registers no ops
namespace {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths,
                            double scale, const c10::optional<at::Tensor>& starts) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "decode_attention: q must be float32 [R, KVH, G, D]");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "decode_attention: k and v must be [R, L, KVH, D] of one dtype");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat,
              "decode_attention: k and v must be bfloat16 or float32");
  const int64_t rows = q.size(0), heads = q.size(1), group = q.size(2), dim = q.size(3);
  TORCH_CHECK(k.size(0) == rows && k.size(2) == heads && k.size(3) == dim, "decode_attention: shapes do not match");
  TORCH_CHECK((dim == 16 || dim == 32 || dim == 64 || dim == 128) && group >= 1 && group <= 8,
              "decode_attention: head size 16, 32, 64 or 128 and 1-8 query heads per KV head");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == rows && lengths.scalar_type() == at::kLong,
              "decode_attention: lengths must be int64 [R]");
  TORCH_CHECK(q.stride(3) == 1, "decode_attention: the head dimension of q must be contiguous");
  const at::Tensor lc = lengths.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= k.size(1), "decode_attention: each length must be in [1, L]");
  at::Tensor sc;
  const int64_t* sp = nullptr;
  if (starts.has_value()) {
    TORCH_CHECK(starts->dim() == 1 && starts->size(0) == rows && starts->scalar_type() == at::kLong,
                "decode_attention: starts must be int64 [R]");
    sc = starts->contiguous();
    sp = sc.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < lp[r], "decode_attention: each start must be in [0, length)");
  }
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  attend(q, k, v, lp, sp, static_cast<float>(scale), out);
  return out;
}

}  // namespace
#endif  // POCKETLLM_NO_TORCH_OPS
}  // namespace pocketllm_cpu

#ifndef POCKETLLM_NO_TORCH_OPS
TORCH_LIBRARY_FRAGMENT(pocketllm_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale, Tensor? starts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm_cpu, CPU, m) {
  m.impl("decode_attention", &pocketllm_cpu::decode_attention);
}
#endif  // POCKETLLM_NO_TORCH_OPS
