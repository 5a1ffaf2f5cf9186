// The GGUF reader (gguf.h).
#include "gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace pocket {
namespace {

constexpr uint64_t kDefaultAlignment = 32;
// Metadata value types.
enum : uint32_t { kU8 = 0, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64 };

struct TypeInfo {
  uint32_t id;
  const char* name;
  int64_t block_elements, block_bytes;
};
const TypeInfo kTypes[] = {
    {0, "F32", 1, 4},       {1, "F16", 1, 2},        {2, "Q4_0", 32, 18},    {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},    {7, "Q5_1", 32, 24},     {8, "Q8_0", 32, 34},    {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},  {11, "Q3_K", 256, 110},  {12, "Q4_K", 256, 144}, {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210}, {15, "Q8_K", 256, 292},  {24, "I8", 1, 1},       {25, "I16", 1, 2},
    {26, "I32", 1, 4},      {27, "I64", 1, 8},       {28, "F64", 1, 8},      {30, "BF16", 1, 2},
};

const TypeInfo* type_info(uint32_t id) {
  for (const TypeInfo& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

// Bounds-checked little-endian reads over the map.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t pos() const { return pos_; }

  template <typename T>
  T read() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string string() {
    const uint64_t length = read<uint64_t>();
    need(length);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(length));
    pos_ += static_cast<size_t>(length);
    return s;
  }
  GgufValue value(uint32_t kind) {
    GgufValue v;
    switch (kind) {
      case kU8: v.integer = read<uint8_t>(); break;
      case kI8: v.integer = read<int8_t>(); break;
      case kU16: v.integer = read<uint16_t>(); break;
      case kI16: v.integer = read<int16_t>(); break;
      case kU32: v.integer = read<uint32_t>(); break;
      case kI32: v.integer = read<int32_t>(); break;
      case kU64: v.integer = static_cast<int64_t>(read<uint64_t>()); break;
      case kI64: v.integer = read<int64_t>(); break;
      case kF32: v.kind = GgufValue::Kind::Float; v.number = read<float>(); break;
      case kF64: v.kind = GgufValue::Kind::Float; v.number = read<double>(); break;
      case kBool: v.kind = GgufValue::Kind::Bool; v.boolean = read<uint8_t>() != 0; break;
      case kString: v.kind = GgufValue::Kind::String; v.text = string(); break;
      case kArray: {
        v.kind = GgufValue::Kind::Array;
        const uint32_t item_kind = read<uint32_t>();
        const uint64_t count = read<uint64_t>();
        if (count > size_ - pos_) throw std::runtime_error("an array runs past the end of the file");
        v.items.reserve(static_cast<size_t>(count));
        for (uint64_t i = 0; i < count; ++i) v.items.push_back(value(item_kind));
        break;
      }
      default: throw std::runtime_error("unknown metadata value type " + std::to_string(kind));
    }
    if (v.kind == GgufValue::Kind::Int) v.number = static_cast<double>(v.integer);
    return v;
  }

 private:
  void need(uint64_t n) const {
    if (n > size_ - pos_) throw std::runtime_error("the file ends inside its header");
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

std::string ggml_type_name(uint32_t type) {
  const TypeInfo* t = type_info(type);
  return t ? t->name : "type " + std::to_string(type);
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool is_gguf_path(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
}

GgufFile::GgufFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) { ::close(fd); throw std::runtime_error("cannot stat " + path); }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 24) { ::close(fd); throw std::runtime_error(path + " is not a GGUF file (too short)"); }
  void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) throw std::runtime_error("cannot map " + path);
  map_ = map;
  const auto* bytes = static_cast<const uint8_t*>(map_);
  try {
    Cursor in(bytes, size_);
    if (std::memcmp(bytes, "GGUF", 4) != 0) throw std::runtime_error("no GGUF magic at the start");
    in.read<uint32_t>();
    const uint32_t version = in.read<uint32_t>();
    if (version != 2 && version != 3)
      throw std::runtime_error("GGUF version " + std::to_string(version) + " (readable: 2, 3)");
    const uint64_t tensor_count = in.read<uint64_t>(), kv_count = in.read<uint64_t>();
    for (uint64_t i = 0; i < kv_count; ++i) {
      std::string key = in.string();
      metadata_[key] = in.value(in.read<uint32_t>());
    }
    struct Described { std::string name; std::vector<uint64_t> dims; uint32_t type; uint64_t offset; };
    std::vector<Described> described;
    for (uint64_t i = 0; i < tensor_count; ++i) {
      Described d;
      d.name = in.string();
      const uint32_t n_dims = in.read<uint32_t>();
      if (n_dims > 8) throw std::runtime_error("tensor " + d.name + " has " + std::to_string(n_dims) + " dimensions");
      for (uint32_t k = 0; k < n_dims; ++k) d.dims.push_back(in.read<uint64_t>());
      d.type = in.read<uint32_t>();
      d.offset = in.read<uint64_t>();
      described.push_back(std::move(d));
    }
    const int64_t alignment = integer_or("general.alignment", kDefaultAlignment);
    if (alignment <= 0) throw std::runtime_error("general.alignment is " + std::to_string(alignment));
    const uint64_t a = static_cast<uint64_t>(alignment);
    const uint64_t data_start = (in.pos() + a - 1) / a * a;
    for (const Described& d : described) {
      GgufTensor t;
      t.name = d.name;
      t.type = d.type;
      for (auto it = d.dims.rbegin(); it != d.dims.rend(); ++it) t.shape.push_back(static_cast<int64_t>(*it));
      const int64_t row = d.dims.empty() ? 1 : static_cast<int64_t>(d.dims[0]);
      const int64_t rows = row == 0 ? 0 : t.numel() / row;
      if (const TypeInfo* info = type_info(d.type)) {
        if (row % info->block_elements != 0)
          throw std::runtime_error("tensor " + d.name + ": a row of " + std::to_string(row) + " is not whole " +
                                   info->name + " blocks");
        t.bytes = static_cast<size_t>(rows * (row / info->block_elements) * info->block_bytes);
      }
      if (data_start + d.offset > size_ || t.bytes > size_ - data_start - d.offset)
        throw std::runtime_error("tensor " + d.name + " runs past the end of the file");
      t.data = bytes + data_start + d.offset;
      tensors_.push_back(std::move(t));
    }
  } catch (const std::exception& err) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw std::runtime_error(path + " is not a readable GGUF file: " + err.what());
  }
}

GgufFile::~GgufFile() {
  if (map_) ::munmap(map_, size_);
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  for (const GgufTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

int64_t GgufFile::integer(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw std::invalid_argument("GGUF metadata lacks '" + key + "'");
  if (v->kind != GgufValue::Kind::Int) throw std::invalid_argument("GGUF metadata '" + key + "' is not an integer");
  return v->integer;
}

double GgufFile::number(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw std::invalid_argument("GGUF metadata lacks '" + key + "'");
  if (v->kind != GgufValue::Kind::Int && v->kind != GgufValue::Kind::Float)
    throw std::invalid_argument("GGUF metadata '" + key + "' is not a number");
  return v->number;
}

int64_t GgufFile::integer_or(const std::string& key, int64_t fallback) const {
  return find(key) ? integer(key) : fallback;
}

double GgufFile::number_or(const std::string& key, double fallback) const {
  return find(key) ? number(key) : fallback;
}

std::string GgufFile::string_or(const std::string& key, const std::string& fallback) const {
  const GgufValue* v = find(key);
  return v && v->kind == GgufValue::Kind::String ? v->text : fallback;
}

}  // namespace pocket
