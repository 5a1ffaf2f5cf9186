// The safetensors reader: an 8-byte header length, a JSON header, then raw little-endian tensor data.
#include "safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "json.h"

namespace pocket {
namespace {

struct Mapped {
  void* data = MAP_FAILED;
  size_t size = 0;
  ~Mapped() { if (data != MAP_FAILED) munmap(data, size); }
};

at::ScalarType dtype_of(const std::string& name, const std::string& path) {
  if (name == "F32") return at::kFloat;
  if (name == "BF16") return at::kBFloat16;
  if (name == "F16") return at::kHalf;
  throw std::runtime_error(path + ": tensor dtype " + name + " is not supported by the native engine "
                           "(F32, BF16 and F16 are)");
}

void load_file(const std::string& path, TensorMap& out) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  struct stat st {};
  if (fstat(fd, &st) != 0) { close(fd); throw std::runtime_error("cannot stat " + path); }
  Mapped m;
  m.size = static_cast<size_t>(st.st_size);
  if (m.size < 8) { close(fd); throw std::runtime_error(path + " is not a safetensors file (too short)"); }
  m.data = mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (m.data == MAP_FAILED) throw std::runtime_error("cannot map " + path);
  const auto* bytes = static_cast<const uint8_t*>(m.data);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);
  if (header_len > m.size - 8) throw std::runtime_error(path + ": header length past the end of the file");
  Json header = Json::parse(std::string(reinterpret_cast<const char*>(bytes + 8), header_len));
  const uint8_t* base = bytes + 8 + header_len;
  const size_t data_size = m.size - 8 - header_len;
  for (const auto& [name, info] : header.object) {
    if (name == "__metadata__") continue;
    at::ScalarType dtype = dtype_of(info.at("dtype").as_string(), path);
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (const Json& d : info.at("shape").array) { shape.push_back(d.as_int()); numel *= shape.back(); }
    const auto& offsets = info.at("data_offsets").array;
    if (offsets.size() != 2) throw std::runtime_error(path + ": bad data_offsets of " + name);
    const int64_t begin = offsets[0].as_int(), end = offsets[1].as_int();
    if (begin < 0 || end < begin || static_cast<size_t>(end) > data_size ||
        end - begin != numel * static_cast<int64_t>(c10::elementSize(dtype)))
      throw std::runtime_error(path + ": data_offsets of " + name + " do not match its shape and dtype");
    at::Tensor view = at::from_blob(const_cast<uint8_t*>(base + begin), shape, at::TensorOptions().dtype(dtype));
    out[name] = view.to(at::kFloat).clone();   // a copy the mapping can be released under
  }
}

}  // namespace

TensorMap load_safetensors_dir(const std::string& directory) {
  DIR* dir = opendir(directory.c_str());
  if (!dir) throw std::runtime_error("cannot read checkpoint directory " + directory);
  std::vector<std::string> files;
  while (dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) files.push_back(name);
  }
  closedir(dir);
  if (files.empty()) throw std::runtime_error(directory + " holds no .safetensors file");
  std::sort(files.begin(), files.end());
  TensorMap out;
  for (const auto& name : files) load_file(directory + "/" + name, out);
  return out;
}

}  // namespace pocket
