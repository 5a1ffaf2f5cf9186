// GGUF Q4_1 linear weights kept as 4-bit records and multiplied by PocketLLM's own AVX-512 VNNI kernel
// (pocketllm/kernels/cpu/q4_linear.cpp, compiled into this plane without its torch op registration): the same
// records and the same product as the Torch plane's int4 layers (pocketllm/layers/q4_linear.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pocket {

// Whether this CPU runs the kernel (AVX-512 F, BW, VL, DQ, VNNI; checked at run time).
bool q4_kernel_supported();

// Whether a [out_features, in_features] weight fits the records (in_features a whole number of blocks of 32,
// out_features a multiple of 16).
bool q4_shape_supported(int64_t out_features, int64_t in_features);

// The kernel's records [N / 16, K / 32, 320] (uint8) of a float32 weight [N, K], built as the Python side's
// quantize_q4 and pack_q4 build them: per block of 32 inputs the minimum m and scale d = (max - min) / 15 in fp16
// and the codes round((w - m) / d); for a weight dequantised from GGUF Q4_1 these are the file's own blocks.
at::Tensor q4_pack(const at::Tensor& weight);

// x [T, K] (float32) @ W.T (+ bias) for the weight `records` hold: [T, N] float32. `scratch` holds the quantised
// activations between calls (grown as needed).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bias,
                     std::vector<uint8_t>& scratch);

// Each row of `logits` [T, V] (float32, contiguous): its `count` highest recomputed in place as the float32 dot
// products of that row of x [T, K] with those rows of `weight` [>= V, K] (float32), by the project's rescoring
// kernel (pocketllm/kernels/cpu/lm_head_rescore.cpp), as the Torch plane's LM head does. K a multiple of 16.
void rescore_top(at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight, int64_t count);

}  // namespace pocket
