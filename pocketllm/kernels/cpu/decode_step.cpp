// The layers of a Llama-family decode step on CPU in one call, for int4 weights held as q4 records
// (pocketllm/runner/cpu_decode.py decides when it runs). Per layer: RMSNorm, the QKV product (plus its bias),
// rotary embedding (rotate-half, the sign folded into sin), the new K/V stored into the paged cache (and into the
// dense rows of a multi-row step), decode attention over the context, the output product added to the residual,
// RMSNorm, the gate/up product, SiLU(gate) * up and the down product. The same arithmetic as the step's torch ops
// around q4_linear and decode_attention, without a dispatcher call, a tensor or a Python frame per op (150 kernel
// calls and ~450 small ops a step for a 30-layer model).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace pocketllm_cpu {
namespace {

constexpr int64_t kPerLayer = 6;   // weights per layer: norm 1, qkv, o, norm 2, gate/up, down

template <typename T>
void store_row(const float* values, int64_t n, T* target) {
  for (int64_t i = 0; i < n; ++i) target[i] = static_cast<T>(values[i]);
}

template <typename T>
void store_kv(const float* k, const float* v, int64_t rows, int64_t width, const int64_t* slots,
              const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* row_index,
              const at::Tensor* k_rows, const at::Tensor* v_rows) {
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    store_row(k + r * width, width, kc + slots[r] * k_cache.stride(0));
    store_row(v + r * width, width, vc + slots[r] * v_cache.stride(0));
    if (row_index != nullptr) {
      store_row(k + r * width, width, k_rows->data_ptr<T>() + row_index[r] * width);
      store_row(v + r * width, width, v_rows->data_ptr<T>() + row_index[r] * width);
    }
  }
}

at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList weights, at::TensorList qkv_bias,
                         at::TensorList caches, const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList rows_kv, const std::optional<at::Tensor>& row_index, int64_t span_start,
                         const at::Tensor& lengths, int64_t heads, int64_t kv_heads, double eps, double scale,
                         const at::Tensor& final_norm, double final_eps, at::IntArrayRef windows,
                         const std::optional<at::Tensor>& row_seq) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "decode_layers: six weights per layer");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * layers, "decode_layers: a K and a V cache per layer");
  TORCH_CHECK(rows_kv.empty() || static_cast<int64_t>(rows_kv.size()) == 2 * layers,
              "decode_layers: dense K and V rows per layer, or none");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers,
              "decode_layers: a QKV bias per layer, or none");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: a sliding window per layer (0: none), or none");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "decode_layers: hidden must be float32 [R, H]");
  const int64_t rows = hidden.size(0), width = hidden.size(1), dim = cos.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && dim % 2 == 0 && width % kBlock == 0, "decode_layers: unsupported heads");
  const int64_t q_width = heads * dim, kv_width = kv_heads * dim;
  const int64_t qkv_n = weights[1].size(0) * kTile, inter = weights[4].size(0) * kTile / 2;
  TORCH_CHECK(qkv_n == q_width + 2 * kv_width && weights[2].size(1) * kBlock == q_width &&
              weights[5].size(1) * kBlock == inter && inter % kBlock == 0,
              "decode_layers: weight shapes do not match the heads");
  TORCH_CHECK(slots.size(0) == rows && lengths.size(0) == rows && cos.size(0) == rows && sin.size(0) == rows,
              "decode_layers: one slot, length and rotary row per row");
  TORCH_CHECK(rows_kv.empty() || row_index.has_value(), "decode_layers: dense rows need their row index");
  TORCH_CHECK(!row_seq.has_value() || (!rows_kv.empty() && row_seq->size(0) == rows &&
                                        row_seq->scalar_type() == at::kLong),
              "decode_layers: row_seq (int64 [R]) names each row's dense row");
  at::Tensor seq_c;
  const int64_t* seq_p = nullptr;
  if (row_seq.has_value()) {
    seq_c = row_seq->contiguous();
    seq_p = seq_c.data_ptr<int64_t>();
  }
  const at::ScalarType kv_type = caches[0].scalar_type();
  TORCH_CHECK(kv_type == at::kBFloat16 || kv_type == at::kFloat, "decode_layers: the KV cache is bfloat16 or float32");

  const at::Tensor slots_c = slots.contiguous(), lengths_c = lengths.contiguous();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const int64_t* slot_p = slots_c.data_ptr<int64_t>();
  const int64_t* length_p = lengths_c.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(length_p, length_p + rows);
  std::vector<int64_t> starts(rows);   // a windowed layer's first attended position per row
  at::Tensor index_c;
  const int64_t* index_p = nullptr;
  if (!rows_kv.empty()) {
    index_c = row_index->contiguous();
    index_p = index_c.data_ptr<int64_t>();
  }

  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor residual = hidden.contiguous().clone();
  at::Tensor x = at::empty({rows, width}, f32);
  at::Tensor qkv = at::empty({rows, qkv_n}, f32);
  at::Tensor q = at::empty({rows, kv_heads, heads / kv_heads, dim}, f32);
  at::Tensor k_new = at::empty({rows, kv_width}, f32);
  at::Tensor v_new = at::empty({rows, kv_width}, f32);
  at::Tensor attended = at::empty({rows, kv_heads, heads / kv_heads, dim}, f32);
  at::Tensor projected = at::empty({rows, width}, f32);
  at::Tensor gate_up = at::empty({rows, 2 * inter}, f32);
  at::Tensor activated = at::empty({rows, inter}, f32);
  at::Tensor scratch = at::empty({q4_scratch_bytes(rows, std::max({width, q_width, inter}))},
                                 hidden.options().dtype(at::kByte));
  float* res_p = residual.data_ptr<float>();
  float* x_p = x.data_ptr<float>();
  float* qkv_p = qkv.data_ptr<float>();
  float* q_p = q.data_ptr<float>();
  float* k_p = k_new.data_ptr<float>();
  float* v_p = v_new.data_ptr<float>();
  float* proj_p = projected.data_ptr<float>();
  float* gu_p = gate_up.data_ptr<float>();
  float* act_p = activated.data_ptr<float>();
  uint8_t* scratch_p = scratch.data_ptr<uint8_t>();
  const float* cos_p = cos_c.data_ptr<float>();
  const float* sin_p = sin_c.data_ptr<float>();

  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    if (l > 0) add_into(res_p, proj_p, rows * width);   // the previous layer's MLP output
    rms_norm_rows(res_p, rows, width, w[0].data_ptr<float>(), static_cast<float>(eps), x_p);
    q4_matmul(x_p, rows, w[1], qkv_p, scratch_p);
    if (!qkv_bias.empty()) {
      for (int64_t r = 0; r < rows; ++r) add_into(qkv_p + r * qkv_n, qkv_bias[l].data_ptr<float>(), qkv_n);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = qkv_p + r * qkv_n;
      rotate_heads(row, heads, dim, cos_p + r * dim, sin_p + r * dim, q_p + r * q_width);
      rotate_heads(row + q_width, kv_heads, dim, cos_p + r * dim, sin_p + r * dim, k_p + r * kv_width);
      std::copy(row + q_width + kv_width, row + qkv_n, v_p + r * kv_width);
    }
    const at::Tensor& k_cache = caches[2 * l];
    const at::Tensor& v_cache = caches[2 * l + 1];
    const at::Tensor* k_rows = rows_kv.empty() ? nullptr : &rows_kv[2 * l];
    const at::Tensor* v_rows = rows_kv.empty() ? nullptr : &rows_kv[2 * l + 1];
    if (kv_type == at::kBFloat16) {
      store_kv<at::BFloat16>(k_p, v_p, rows, kv_width, slot_p, k_cache, v_cache, index_p, k_rows, v_rows);
    } else {
      store_kv<float>(k_p, v_p, rows, kv_width, slot_p, k_cache, v_cache, index_p, k_rows, v_rows);
    }
    at::Tensor keys, values;
    if (k_rows != nullptr) {
      // With row_seq, rows of one sequence (a verify chunk's positions) read its dense row.
      const int64_t held = seq_p != nullptr ? k_rows->size(0) : rows;
      keys = k_rows->narrow(0, 0, held).narrow(1, 0, longest);
      values = v_rows->narrow(0, 0, held).narrow(1, 0, longest);
    } else {
      // Several rows over a span are positions of one sequence (a verify step): each attends to its length.
      keys = k_cache.narrow(0, span_start, longest).view({1, longest, kv_heads, dim}).expand({rows, -1, -1, -1});
      values = v_cache.narrow(0, span_start, longest).view({1, longest, kv_heads, dim}).expand({rows, -1, -1, -1});
    }
    const int64_t window = windows.empty() ? 0 : windows[l];
    if (window > 0) {
      for (int64_t r = 0; r < rows; ++r) starts[r] = std::max<int64_t>(0, length_p[r] - window);
    }
    attend(q, keys, values, length_p, window > 0 ? starts.data() : nullptr, static_cast<float>(scale), attended,
           seq_p);
    q4_matmul(attended.data_ptr<float>(), rows, w[2], proj_p, scratch_p);
    add_into(res_p, proj_p, rows * width);
    rms_norm_rows(res_p, rows, width, w[3].data_ptr<float>(), static_cast<float>(eps), x_p);
    q4_matmul(x_p, rows, w[4], gu_p, scratch_p);
    silu_mul_rows(gu_p, rows, inter, act_p);
    q4_matmul(act_p, rows, w[5], proj_p, scratch_p);
  }
  add_into(res_p, proj_p, rows * width);
  at::Tensor out = at::empty({rows, width}, f32);
  rms_norm_rows(res_p, rows, width, final_norm.data_ptr<float>(), static_cast<float>(final_eps),
                out.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace pocketllm_cpu

TORCH_LIBRARY_FRAGMENT(pocketllm_cpu, m) {
  m.def("decode_layers(Tensor hidden, Tensor[] weights, Tensor[] qkv_bias, Tensor(a!)[] caches, Tensor slots, "
        "Tensor cos, Tensor sin, Tensor(b!)[] rows, Tensor? row_index, int span_start, Tensor lengths, int heads, "
        "int kv_heads, float eps, float scale, Tensor final_norm, float final_eps, int[] windows=[], "
        "Tensor? row_seq=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm_cpu, CPU, m) {
  m.impl("decode_layers", &pocketllm_cpu::decode_layers);
}
