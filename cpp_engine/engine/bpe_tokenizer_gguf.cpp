// BpeTokenizer::from_gguf: a byte-level BPE vocabulary from GGUF metadata (tokenizer.ggml.model "gpt2"), built as
// transformers' GGUF conversion builds it, so that both encode text alike:
// - tokens spelled outside the byte-level alphabet are looked up by their UTF-8 bytes spelled in it;
// - control tokens (token type 3) are special added tokens and user-defined ones (type 4) plain added tokens,
//   both matched whole in the text at their GGUF ids;
// - tokenizer.ggml.pre picks the split: the Llama-3 and Qwen2 families' patterns, else GPT-2's (ByteLevel's own,
//   which SmolLM2's "smollm" gets); the other patterns transformers knows are refused by name;
// - tokenizer.ggml.add_bos_token / add_eos_token put those tokens around an encoded prompt.
#include <set>
#include <stdexcept>

#include "../src/gguf.h"
#include "bpe_tokenizer.h"

namespace pocket {
namespace {

constexpr int64_t kControl = 3, kUserDefined = 4;

const std::set<std::string> kLlama3Splits = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                             "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"};
const std::set<std::string> kQwenSplits = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"};
const std::set<std::string> kUnimplementedSplits = {"tekken", "qwen35", "gpt-4o", "llama4", "kanana2", "talkie",
                                                    "minimax-m2"};

const GgufValue& list(const GgufFile& file, const std::string& key) {
  const GgufValue* v = file.find(key);
  if (!v || v->kind != GgufValue::Kind::Array) throw std::runtime_error(file.path() + ": no " + key + " list");
  return *v;
}

bool flag(const GgufFile& file, const std::string& key) {
  const GgufValue* v = file.find(key);
  return v && v->kind == GgufValue::Kind::Bool && v->boolean;
}

}  // namespace

BpeTokenizer BpeTokenizer::from_gguf(const GgufFile& file) {
  const std::string model = file.string_or("tokenizer.ggml.model", "");
  if (model != "gpt2")
    throw std::runtime_error(file.path() + ": tokenizer.ggml.model '" + model +
                             "' is not supported (byte-level BPE, 'gpt2', only)");
  BpeTokenizer t;
  const std::string pre = file.string_or("tokenizer.ggml.pre", "default");
  if (kUnimplementedSplits.count(pre))
    throw std::runtime_error(file.path() + ": the pre-tokenizer '" + pre + "' splits with a pattern this tokenizer "
                             "does not implement (the GPT-2, Qwen or Llama-3 byte-level patterns)");
  t.split_ = kLlama3Splits.count(pre) ? Split::Llama3 : kQwenSplits.count(pre) ? Split::Qwen : Split::Gpt2;

  const GgufValue& tokens = list(file, "tokenizer.ggml.tokens");
  const GgufValue* types = file.find("tokenizer.ggml.token_type");
  const int64_t size = static_cast<int64_t>(tokens.items.size());
  for (int64_t id = 0; id < size; ++id) {
    const std::string& token = tokens.items[id].text;
    if (t.in_byte_alphabet(token)) {
      t.vocab_[token] = id;
    } else {
      std::string spelled;
      for (unsigned char c : token) spelled += t.byte_to_char_[c];
      t.vocab_[spelled] = id;
    }
  }
  t.index_vocab(size);
  if (types && types->kind == GgufValue::Kind::Array) {
    for (int64_t id = 0; id < size && id < static_cast<int64_t>(types->items.size()); ++id) {
      const std::string& token = tokens.items[id].text;
      const int64_t type = types->items[id].integer;
      if (type == kControl) t.add_token(token, id, true);
      else if (type == kUserDefined && t.vocab_.count(token)) t.add_token(token, id, false);
    }
  }
  t.sort_added();
  int64_t rank = 0;
  for (const GgufValue& m : list(file, "tokenizer.ggml.merges").items) t.merge_rank_.emplace(m.text, rank++);
  const int64_t bos = file.integer_or("tokenizer.ggml.bos_token_id", -1);
  const int64_t eos = file.integer_or("tokenizer.ggml.eos_token_id", -1);
  if (flag(file, "tokenizer.ggml.add_bos_token") && bos >= 0) t.prefix_ids_.push_back(bos);
  if (flag(file, "tokenizer.ggml.add_eos_token") && eos >= 0) t.suffix_ids_.push_back(eos);
  return t;
}

}  // namespace pocket
