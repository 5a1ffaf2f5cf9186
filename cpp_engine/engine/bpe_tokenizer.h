// A byte-level BPE tokenizer read from a checkpoint's tokenizer.json (the GPT-2 / Qwen family): added tokens
// matched first, the pre-tokenizer split the file declares (hand-written, see pretokenize), merges by rank,
// and decoding through the byte-level mapping, streamed so that no chunk splits a UTF-8 character.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace pocket {

class GgufFile;

class BpeTokenizer {
 public:
  // Throws std::runtime_error naming what it does not support (a model other than BPE, an unknown split).
  explicit BpeTokenizer(const std::string& tokenizer_json_path);
  // The tokenizer a GGUF file's tokenizer.ggml.* metadata describes, as transformers converts it
  // (bpe_tokenizer_gguf.cpp).
  static BpeTokenizer from_gguf(const GgufFile& file);

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens) const;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const;   // invalid UTF-8 -> U+FFFD
  std::string token_bytes(int64_t id) const;   // the raw bytes of one token ("" for an unknown id)
  bool is_special(int64_t id) const { return special_ids_.count(id) > 0; }
  int64_t token_id(const std::string& content) const;   // an added token's or a vocabulary entry's id, else -1
  int64_t max_token_bytes() const { return max_token_bytes_; }   // longest token, in bytes
  int64_t vocab_size() const { return static_cast<int64_t>(id_to_bytes_.size()); }
  // The pieces the pre-tokenizer splits `text` into (UTF-8 strings), for tests.
  std::vector<std::string> pretokenize(const std::string& text) const;

 private:
  enum class Split { Gpt2, Qwen, Llama3 };
  static constexpr uint32_t kAlphabetEnd = 256 + 68;   // the byte-level alphabet's code points are below this
  BpeTokenizer() { init_byte_alphabet(); }
  void init_byte_alphabet();
  std::string spelled_bytes(const std::string& token) const;   // a byte-level spelled token's raw bytes
  bool in_byte_alphabet(const std::string& token) const;
  void index_vocab(int64_t size);   // id_to_bytes_ of every vocab_ entry, for ids [0, size)
  void add_token(const std::string& content, int64_t id, bool special);
  void sort_added();                // longest first, as they are matched
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_plain(const std::string& text, std::vector<int64_t>& out) const;

  Split split_ = Split::Gpt2;
  bool add_prefix_space_ = false;
  std::unordered_map<std::string, int64_t> vocab_;          // byte-level-mapped token string -> id
  std::unordered_map<std::string, int64_t> merge_rank_;     // "left right" -> rank
  std::vector<std::string> id_to_bytes_;                    // id -> raw bytes
  std::vector<std::pair<std::string, int64_t>> added_;      // added tokens, longest first
  std::unordered_set<int64_t> special_ids_;
  std::vector<int64_t> prefix_ids_, suffix_ids_;            // the post-processor's special tokens (single)
  std::string byte_to_char_[256];                           // byte -> its mapped character (UTF-8)
  int16_t byte_of_char_[kAlphabetEnd];                      // mapped code point -> byte, or -1
  int64_t max_token_bytes_ = 0;
};

// Streams decoded bytes out as whole UTF-8 characters: push a token's bytes, take what is complete.
class Utf8Stream {
 public:
  std::string push(const std::string& bytes);   // complete characters so far (invalid bytes -> U+FFFD)
  std::string flush();                          // whatever is left (an unfinished character -> U+FFFD)
 private:
  std::string pending_;
};

}  // namespace pocket
