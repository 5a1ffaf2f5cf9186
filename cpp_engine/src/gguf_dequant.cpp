// GGUF dequantisation (gguf_dequant.h).
#include "gguf_dequant.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <stdexcept>

namespace pocket {
namespace {

constexpr int64_t kBlock = 32;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block of `block_bytes` bytes into 32 floats.
void q8_0_block(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int64_t j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
}
void q4_0_block(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    out[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
    out[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
}
void q4_1_block(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    out[j] = d * static_cast<float>(b[4 + j] & 0x0F) + m;
    out[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
}

at::Tensor blocks(const GgufTensor& t, int64_t block_bytes, void (*decode)(const uint8_t*, float*)) {
  at::Tensor out = at::empty(t.shape, at::kFloat);
  float* dst = out.data_ptr<float>();
  const int64_t n = t.numel() / kBlock;
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) decode(t.data + i * block_bytes, dst + i * kBlock);
  });
  return out;
}

}  // namespace

at::Tensor dequantize(const GgufTensor& t) {
  const auto view = [&](at::ScalarType dtype) {
    return at::from_blob(const_cast<uint8_t*>(t.data), t.shape, at::TensorOptions().dtype(dtype)).to(at::kFloat);
  };
  switch (static_cast<GgmlType>(t.type)) {
    case GgmlType::F32: return view(at::kFloat).clone();
    case GgmlType::F16: return view(at::kHalf);
    case GgmlType::BF16: return view(at::kBFloat16);
    case GgmlType::Q8_0: return blocks(t, 34, q8_0_block);
    case GgmlType::Q4_0: return blocks(t, 18, q4_0_block);
    case GgmlType::Q4_1: return blocks(t, 20, q4_1_block);
    default:
      throw std::invalid_argument("GGUF tensor " + t.name + " has type " + ggml_type_name(t.type) +
                                  ", which the native engine cannot dequantise (F32, F16, BF16, Q8_0, Q4_0 and "
                                  "Q4_1 are read)");
  }
}

}  // namespace pocket
