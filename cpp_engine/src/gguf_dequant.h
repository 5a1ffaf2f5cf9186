// GGUF tensor data to float32 at load: F32, F16, BF16 and the 32-element block types Q8_0, Q4_0 and Q4_1.
//
// Block layouts: Q8_0 is a float16 scale d then 32 int8 values (d * q); Q4_0 is d then 16 bytes of 4-bit values
// (d * (q - 8)); Q4_1 is d, a float16 minimum m, then 16 bytes (d * q + m). In the 4-bit types byte j of a block
// holds element j in its low nibble and element j + 16 in its high one.
#pragma once

#include <ATen/ATen.h>

#include "gguf.h"

namespace pocket {

// A new contiguous float32 tensor of `tensor.shape`; throws std::invalid_argument for another type.
at::Tensor dequantize(const GgufTensor& tensor);

}  // namespace pocket
