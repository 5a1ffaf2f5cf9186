// A GGUF file (versions 2 and 3, little-endian) read from a memory map: its metadata key/values and the
// descriptions of its tensors, whose data stays in the map until dequantised (gguf_dequant.h).
//
// Layout: the magic "GGUF", a uint32 version, uint64 tensor and metadata counts; each metadata entry is a string
// key, a uint32 value type and the value (an array: a uint32 element type, a uint64 count, the elements); each
// tensor description is a string name, a uint32 dimension count, uint64 dimensions (fastest first), a uint32
// GGML type and a uint64 offset into the data section, which starts at the next multiple of general.alignment
// (32 when absent) after the descriptions. A string is a uint64 byte length and its UTF-8 bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace pocket {

// One metadata value: a scalar (an integer of any width in `integer`, a uint64 cast; every number also in
// `number`), a string, or an array of values of one type.
struct GgufValue {
  enum class Kind { Int, Float, Bool, String, Array };
  Kind kind = Kind::Int;
  int64_t integer = 0;
  double number = 0;
  bool boolean = false;
  std::string text;
  std::vector<GgufValue> items;
};

// The GGML tensor types gguf_dequant.h converts (gguf.cpp knows the block sizes and names of more, the k-quants
// among them, so that a refusal names the type).
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };
std::string ggml_type_name(uint32_t type);   // "Q4_K", or "type N" for an id it does not know

struct GgufTensor {
  std::string name;
  std::vector<int64_t> shape;   // row-major ("HF") order: GGUF's dimensions reversed
  uint32_t type = 0;
  const uint8_t* data = nullptr;   // into the file's map (valid while the GgufFile lives)
  size_t bytes = 0;                // 0 for a type whose block size this reader does not know
  int64_t numel() const;
};

class GgufFile {
 public:
  // Throws std::runtime_error naming what is wrong with the file.
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  const GgufValue* find(const std::string& key) const;
  const GgufTensor* tensor(const std::string& name) const;
  // Typed reads of one key; the first two throw std::invalid_argument when it is absent or of another type.
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;   // an integer value is read as a number too
  int64_t integer_or(const std::string& key, int64_t fallback) const;
  double number_or(const std::string& key, double fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
};

// Whether `path` names a GGUF file (by its extension), as a --model argument.
bool is_gguf_path(const std::string& path);

}  // namespace pocket
