// The 4-bit weights (q4_weights.h). Built with the AVX-512 flags the kernel's header needs; nothing here runs
// unless q4_kernel_supported() (whose own file, q4_cpu.cpp, is built without them) said so.
#include "q4_weights.h"

#include <stdexcept>

#include "cpu_kernels.h"

namespace pocket {

bool q4_shape_supported(int64_t out_features, int64_t in_features) {
  return in_features % pocketllm_cpu::kBlock == 0 && in_features >= pocketllm_cpu::kBlock &&
         out_features % pocketllm_cpu::kTile == 0 && out_features > 0;
}

at::Tensor q4_pack(const at::Tensor& weight) {
  using pocketllm_cpu::kBlock;
  using pocketllm_cpu::kTile;
  const int64_t rows = weight.size(0), cols = weight.size(1);
  if (!q4_shape_supported(rows, cols)) throw std::invalid_argument("q4_pack: the weight's shape does not fit the records");
  const int64_t tiles = rows / kTile, blocks = cols / kBlock;
  at::Tensor groups = weight.to(at::kFloat).reshape({rows, blocks, kBlock});
  at::Tensor low = std::get<0>(groups.min(-1)), high = std::get<0>(groups.max(-1));
  at::Tensor scale = ((high - low) / 15).to(at::kHalf);
  at::Tensor minimum = low.to(at::kHalf);
  at::Tensor step = at::where(scale > 0, scale.to(at::kFloat), at::ones_like(low));
  at::Tensor codes = at::round((groups - minimum.to(at::kFloat).unsqueeze(-1)) / step.unsqueeze(-1))
                         .clamp_(0, 15).to(at::kByte);
  // input k = 32 * block + 8 * chunk + 4 * half + i; a byte holds half 0 in its low nibble, half 1 in its high.
  at::Tensor c = codes.reshape({tiles, kTile, blocks, 4, 2, 4}).permute({0, 2, 3, 1, 5, 4});   // [.., i, half]
  at::Tensor nibbles = at::bitwise_or(c.select(-1, 0), at::bitwise_left_shift(c.select(-1, 1), 4))
                           .reshape({tiles, blocks, 256});
  auto per_lane = [&](const at::Tensor& v) {
    return v.reshape({tiles, kTile, blocks}).permute({0, 2, 1}).contiguous().view(at::kByte);
  };
  return at::cat({nibbles, per_lane(scale), per_lane(minimum)}, -1).contiguous();
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                     std::vector<uint8_t>& scratch) {
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  if (k != records.size(1) * pocketllm_cpu::kBlock) throw std::logic_error("q4_linear: shapes do not match");
  at::Tensor out = at::empty({rows, records.size(0) * pocketllm_cpu::kTile}, xc.options());
  if (rows == 0) return out;
  const size_t need = static_cast<size_t>(pocketllm_cpu::q4_scratch_bytes(rows, k));
  if (scratch.size() < need) scratch.resize(need);
  pocketllm_cpu::q4_matmul(xc.data_ptr<float>(), rows, records, out.data_ptr<float>(), scratch.data());
  if (bias.defined()) out.add_(bias);
  return out;
}

void rescore_top(at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight, int64_t count) {
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  if (logits.dim() != 2 || !logits.is_contiguous() || logits.scalar_type() != at::kFloat || xc.dim() != 2 ||
      xc.size(1) % 16 != 0 || xc.size(0) != logits.size(0) || weight.dim() != 2 ||
      weight.scalar_type() != at::kFloat || weight.stride(1) != 1 || weight.size(1) != xc.size(1) ||
      weight.size(0) < logits.size(1) || count < 1 || count > logits.size(1))
    throw std::logic_error("rescore_top: unsupported shapes, dtypes or count");
  pocketllm_cpu::rescore_top_rows(logits.data_ptr<float>(), logits.size(0), logits.size(1), xc.data_ptr<float>(),
                                  xc.size(1), weight.data_ptr<float>(), weight.stride(0), count);
}

}  // namespace pocket
