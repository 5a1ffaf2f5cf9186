// Reads a checkpoint directory's safetensors files (one file or shards) into float32 CPU tensors.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <unordered_map>

namespace pocket {

using TensorMap = std::unordered_map<std::string, at::Tensor>;

// Every tensor of every *.safetensors file in `directory`, converted to float32 (F32, F16 and BF16 are read).
TensorMap load_safetensors_dir(const std::string& directory);

}  // namespace pocket
