// A GGUF file of the llama, qwen2 or qwen3 architecture as the checkpoint QwenModel runs: the model config from
// the `<arch>.*` metadata and the tensors dequantised to float32 under their Hugging Face names, with llama.cpp's
// per-head row permutation of the llama query and key projections undone.
#pragma once

#include <string>

#include "gguf.h"
#include "qwen_model.h"
#include "safetensors.h"

namespace pocket {

// The config GGUF metadata describes; throws std::invalid_argument for an architecture or feature the native
// engine lacks (another architecture, rope scaling).
QwenConfig read_gguf_config(const GgufFile& file);

// Every tensor of the file, float32, HF-named (model.layers.N.self_attn.q_proj.weight, ...).
TensorMap load_gguf_weights(const GgufFile& file, const QwenConfig& config);

}  // namespace pocket
