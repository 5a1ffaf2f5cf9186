// The byte-level BPE tokenizer (bpe_tokenizer.h).
#include "bpe_tokenizer.h"

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "../src/json.h"

namespace pocket {
namespace {

#include "unicode_classes.inc"

template <size_t N>
bool in_ranges(const uint32_t (&table)[N][2], uint32_t cp) {
  size_t lo = 0, hi = N;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cp < table[mid][0]) hi = mid;
    else if (cp > table[mid][1]) lo = mid + 1;
    else return true;
  }
  return false;
}

bool is_letter(uint32_t cp) { return cp < 0x80 ? ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') : in_ranges(kLetterRanges, cp); }
bool is_number(uint32_t cp) { return cp < 0x80 ? (cp >= '0' && cp <= '9') : in_ranges(kNumberRanges, cp); }
// The Unicode White_Space property (what \s matches).
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}
bool is_other(uint32_t cp) { return !is_space(cp) && !is_letter(cp) && !is_number(cp); }
bool is_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// Length of the valid UTF-8 sequence at s[i] (0: invalid; -1: valid so far but cut short by the end).
int utf8_length(const std::string& s, size_t i, uint32_t* cp_out) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  int len;
  uint32_t cp, min;
  if (c < 0x80) { if (cp_out) *cp_out = c; return 1; }
  if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; min = 0x80; }
  else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; min = 0x800; }
  else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; min = 0x10000; }
  else return 0;
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) {
      // Cut short: valid so far only if the bytes seen could still start a valid character.
      if (k == 1) return -1;
      uint32_t partial = cp << (6 * (len - k));
      if (len == 3 && (partial < 0x800 || (partial >= 0xD800 && partial < 0xE000))) return 0;
      if (len == 4 && (partial < 0x10000 || partial > 0x10FFFF)) return 0;
      return -1;
    }
    unsigned char d = b(i + k);
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3F);
    if (k == 1) {   // reject overlong forms, surrogates and code points past U+10FFFF as early as possible
      uint32_t partial = cp << (6 * (len - 2));
      if (len == 3 && (partial < 0x800 || (partial >= 0xD800 && partial < 0xE000))) return 0;
      if (len == 4 && (partial < 0x10000 || partial > 0x10FFFF)) return 0;
    }
  }
  if (cp < min) return 0;
  if (cp_out) *cp_out = cp;
  return len;
}

// Code points of `text` with their byte offsets (offsets has one more entry: the end); an invalid byte is
// taken as U+FFFD of length 1.
void code_points(const std::string& text, std::vector<uint32_t>& cps, std::vector<size_t>& offsets) {
  size_t i = 0;
  while (i < text.size()) {
    uint32_t cp = 0;
    int len = utf8_length(text, i, &cp);
    if (len <= 0) { cp = 0xFFFD; len = 1; }
    cps.push_back(cp);
    offsets.push_back(i);
    i += static_cast<size_t>(len);
  }
  offsets.push_back(text.size());
}

uint32_t fold(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp | 0x20;
  if (cp == 0x17F) return 's';   // LATIN SMALL LETTER LONG S folds to 's'
  if (cp == 0x212A) return 'k';  // KELVIN SIGN
  return cp;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// The split regexes this tokenizer implements by hand, as tokenizer.json spells them.
const char* kQwenPattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

}  // namespace

BpeTokenizer::BpeTokenizer(const std::string& path) {
  Json root = Json::parse(read_file(path));
  const Json& model = root.at("model");
  if (!model.has("type") || model.at("type").as_string() != "BPE")
    throw std::runtime_error(path + ": only BPE tokenizer models are supported");
  if (const Json* normalizer = root.find("normalizer"); normalizer && !normalizer->is_null()) {
    // NFC is accepted (text arriving in NFC, as nearly all text does, is unchanged by it); others are not.
    const Json* type = normalizer->find("type");
    if (!type || !type->is_string() || type->as_string() != "NFC")
      throw std::runtime_error(path + ": a normalizer other than NFC is not supported");
  }
  init_byte_alphabet();

  const Json* pre = root.find("pre_tokenizer");
  auto byte_level = [&](const Json& p, bool want_regex) {
    const Json* regex = p.find("use_regex");
    bool use_regex = !regex || regex->type != Json::Type::Bool || regex->boolean;
    if (use_regex != want_regex)
      throw std::runtime_error(path + ": this combination of pre-tokenizers is not supported");
    const Json* prefix = p.find("add_prefix_space");
    add_prefix_space_ = prefix && prefix->type == Json::Type::Bool && prefix->boolean;
  };
  if (!pre || pre->is_null()) throw std::runtime_error(path + ": a tokenizer without a pre-tokenizer is not supported");
  const std::string pre_type = pre->at("type").as_string();
  if (pre_type == "ByteLevel") {
    byte_level(*pre, true);
    split_ = Split::Gpt2;
  } else if (pre_type == "Sequence") {
    const Json& list = pre->at("pretokenizers");
    if (list.array.size() != 2 || list.array[0].at("type").as_string() != "Split" ||
        list.array[1].at("type").as_string() != "ByteLevel")
      throw std::runtime_error(path + ": only a Split then ByteLevel pre-tokenizer sequence is supported");
    const Json& split = list.array[0];
    const Json* pattern = split.at("pattern").find("Regex");
    std::string behavior = split.has("behavior") ? split.at("behavior").as_string() : "";
    bool invert = split.has("invert") && split.at("invert").boolean;
    if (!pattern || behavior != "Isolated" || invert)
      throw std::runtime_error(path + ": only an isolating regex Split pre-tokenizer is supported");
    if (pattern->as_string() == kQwenPattern) split_ = Split::Qwen;
    else if (pattern->as_string() == kLlama3Pattern) split_ = Split::Llama3;
    else if (pattern->as_string() == kGpt2Pattern) split_ = Split::Gpt2;
    else throw std::runtime_error(path + ": the pre-tokenizer's split pattern is not one this tokenizer implements "
                                  "(the GPT-2, Qwen or Llama-3 byte-level patterns)");
    byte_level(list.array[1], false);
  } else {
    throw std::runtime_error(path + ": pre-tokenizer " + pre_type + " is not supported (byte-level BPE only)");
  }

  int64_t max_id = -1;
  for (const auto& [token, id] : model.at("vocab").object) {
    vocab_[token] = id.as_int();
    max_id = std::max(max_id, id.as_int());
  }
  const Json* added = root.find("added_tokens");
  if (added && added->is_array())
    for (const Json& a : added->array) max_id = std::max(max_id, a.at("id").as_int());
  index_vocab(max_id + 1);
  if (added && added->is_array()) {
    for (const Json& a : added->array) {
      const std::string& content = a.at("content").as_string();
      int64_t id = a.at("id").as_int();
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        const Json* set = a.find(flag);
        if (set && set->type == Json::Type::Bool && set->boolean)
          throw std::runtime_error(path + ": added token " + content + " sets " + flag +
                                   ", which this tokenizer does not implement");
      }
      add_token(content, id, a.has("special") && a.at("special").boolean);
    }
  }
  sort_added();
  int64_t rank = 0;
  for (const Json& m : model.at("merges").array) {
    std::string key;
    if (m.is_string()) key = m.as_string();
    else if (m.is_array() && m.array.size() == 2) key = m.array[0].as_string() + " " + m.array[1].as_string();
    else throw std::runtime_error(path + ": a merge is neither \"a b\" nor [a, b]");
    merge_rank_.emplace(key, rank++);
  }
  if (const Json* post = root.find("post_processor"); post && !post->is_null()) {
    const std::string type = post->at("type").as_string();
    if (type == "TemplateProcessing") {
      bool before = true;
      for (const Json& item : post->at("single").array) {
        if (item.has("Sequence")) { before = false; continue; }
        const Json& special = item.at("SpecialToken");
        const Json& ids = post->at("special_tokens").at(special.at("id").as_string()).at("ids");
        for (const Json& id : ids.array) (before ? prefix_ids_ : suffix_ids_).push_back(id.as_int());
      }
    } else if (type != "ByteLevel") {
      throw std::runtime_error(path + ": post-processor " + type + " is not supported");
    }
  }
}

void BpeTokenizer::init_byte_alphabet() {
  // The byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map past U+0100.
  int next = 0;
  for (int16_t& b : byte_of_char_) b = -1;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++);
    byte_to_char_[b].clear();
    append_utf8(byte_to_char_[b], cp);
    byte_of_char_[cp] = static_cast<int16_t>(b);
  }
}

std::string BpeTokenizer::spelled_bytes(const std::string& token) const {
  std::string bytes;
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;
  code_points(token, cps, offsets);
  for (size_t k = 0; k < cps.size(); ++k) {
    const int byte = cps[k] < kAlphabetEnd ? byte_of_char_[cps[k]] : -1;
    if (byte >= 0) bytes += static_cast<char>(byte);
    else bytes.append(token, offsets[k], offsets[k + 1] - offsets[k]);
  }
  return bytes;
}

bool BpeTokenizer::in_byte_alphabet(const std::string& token) const {
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;
  code_points(token, cps, offsets);
  for (uint32_t cp : cps)
    if (cp >= kAlphabetEnd || byte_of_char_[cp] < 0) return false;
  return true;
}

void BpeTokenizer::index_vocab(int64_t size) {
  id_to_bytes_.assign(static_cast<size_t>(size), std::string());
  for (const auto& [token, id] : vocab_) {
    std::string bytes = spelled_bytes(token);
    max_token_bytes_ = std::max<int64_t>(max_token_bytes_, static_cast<int64_t>(bytes.size()));
    id_to_bytes_[static_cast<size_t>(id)] = std::move(bytes);
  }
}

void BpeTokenizer::add_token(const std::string& content, int64_t id, bool special) {
  added_.emplace_back(content, id);
  id_to_bytes_[static_cast<size_t>(id)] = content;
  if (special) special_ids_.insert(id);
  max_token_bytes_ = std::max<int64_t>(max_token_bytes_, static_cast<int64_t>(content.size()));
}

void BpeTokenizer::sort_added() {
  std::stable_sort(added_.begin(), added_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

int64_t BpeTokenizer::token_id(const std::string& content) const {
  for (const auto& [text, id] : added_)
    if (text == content) return id;
  std::string mapped;
  for (unsigned char c : content) mapped += byte_to_char_[c];
  auto it = vocab_.find(mapped);
  return it == vocab_.end() ? -1 : it->second;
}

std::string BpeTokenizer::token_bytes(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(id_to_bytes_.size())) return std::string();
  return id_to_bytes_[static_cast<size_t>(id)];
}

std::vector<std::string> BpeTokenizer::pretokenize(const std::string& input) const {
  std::string text = input;
  if (add_prefix_space_ && !text.empty() && text[0] != ' ') text = " " + text;
  std::vector<uint32_t> cp;
  std::vector<size_t> off;
  code_points(text, cp, off);
  const size_t n = cp.size();
  std::vector<std::string> pieces;
  auto run = [&](size_t from, bool (*pred)(uint32_t)) {
    size_t j = from;
    while (j < n && pred(cp[j])) ++j;
    return j;
  };
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    const bool ci = split_ != Split::Gpt2;   // the Qwen/Llama-3 contractions ignore case
    auto c = [&](size_t k) -> uint32_t { return k < n ? (ci ? fold(cp[k]) : cp[k]) : 0; };
    if (cp[i] == '\'' && (c(i + 1) == 's' || c(i + 1) == 't' || c(i + 1) == 'm' || c(i + 1) == 'd')) {
      end = i + 2;
    } else if (cp[i] == '\'' && ((c(i + 1) == 'r' && c(i + 2) == 'e') || (c(i + 1) == 'v' && c(i + 2) == 'e') ||
                                 (c(i + 1) == 'l' && c(i + 2) == 'l'))) {
      end = i + 3;
    } else if (split_ == Split::Gpt2) {
      const bool space = cp[i] == ' ' && i + 1 < n;
      if (space && is_letter(cp[i + 1])) end = run(i + 1, is_letter);
      else if (is_letter(cp[i])) end = run(i, is_letter);
      else if (space && is_number(cp[i + 1])) end = run(i + 1, is_number);
      else if (is_number(cp[i])) end = run(i, is_number);
      else if (space && is_other(cp[i + 1])) end = run(i + 1, is_other);
      else if (is_other(cp[i])) end = run(i, is_other);
      else {
        size_t j = run(i, is_space);
        end = (j == n || j - i == 1) ? j : j - 1;
      }
    } else {
      if (!is_newline(cp[i]) && !is_letter(cp[i]) && !is_number(cp[i]) && i + 1 < n && is_letter(cp[i + 1])) {
        end = run(i + 1, is_letter);
      } else if (is_letter(cp[i])) {
        end = run(i, is_letter);
      } else if (is_number(cp[i])) {
        end = i + 1;
        if (split_ == Split::Llama3)
          while (end < n && end < i + 3 && is_number(cp[end])) ++end;
      } else if ((cp[i] == ' ' && i + 1 < n && is_other(cp[i + 1])) || is_other(cp[i])) {
        end = run(cp[i] == ' ' ? i + 1 : i, is_other);
        end = run(end, is_newline);
      } else {
        size_t j = run(i, is_space);
        size_t last_newline = n;
        for (size_t k = i; k < j; ++k)
          if (is_newline(cp[k])) last_newline = k;
        if (last_newline != n) end = last_newline + 1;
        else end = (j == n || j - i == 1) ? j : j - 1;
      }
    }
    pieces.push_back(text.substr(off[i], off[end] - off[i]));
    i = end;
  }
  return pieces;
}

void BpeTokenizer::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  std::string mapped;
  for (unsigned char ch : piece) mapped += byte_to_char_[ch];
  if (piece.size() == 1) {
    auto single = vocab_.find(mapped);
    if (single != vocab_.end()) { out.push_back(single->second); return; }
  }
  std::vector<std::string> symbols;
  for (unsigned char ch : piece) symbols.push_back(byte_to_char_[ch]);
  while (symbols.size() > 1) {
    int64_t best = INT64_MAX;
    size_t at = 0;
    for (size_t k = 0; k + 1 < symbols.size(); ++k) {
      auto it = merge_rank_.find(symbols[k] + " " + symbols[k + 1]);
      if (it != merge_rank_.end() && it->second < best) { best = it->second; at = k; }
    }
    if (best == INT64_MAX) break;
    const std::string left = symbols[at], right = symbols[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < symbols.size(); ++k) {
      if (k + 1 < symbols.size() && symbols[k] == left && symbols[k + 1] == right) {
        merged.push_back(left + right);
        ++k;
      } else {
        merged.push_back(symbols[k]);
      }
    }
    symbols.swap(merged);
  }
  for (const std::string& s : symbols) {
    auto it = vocab_.find(s);
    if (it == vocab_.end()) throw std::runtime_error("the tokenizer has no token for a merged symbol");
    out.push_back(it->second);
  }
}

void BpeTokenizer::encode_plain(const std::string& text, std::vector<int64_t>& out) const {
  for (const std::string& piece : pretokenize(text)) bpe(piece, out);
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text, bool add_special_tokens) const {
  std::vector<int64_t> out;
  if (add_special_tokens) out = prefix_ids_;
  bool first_byte[256] = {false};
  for (const auto& a : added_)
    if (!a.first.empty()) first_byte[static_cast<unsigned char>(a.first[0])] = true;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const std::pair<std::string, int64_t>* hit = nullptr;
    if (first_byte[static_cast<unsigned char>(text[i])]) {
      for (const auto& a : added_) {
        if (!a.first.empty() && text.compare(i, a.first.size(), a.first) == 0) { hit = &a; break; }
      }
    }
    if (!hit) { ++i; continue; }
    if (i > start) encode_plain(text.substr(start, i - start), out);
    out.push_back(hit->second);
    i += hit->first.size();
    start = i;
  }
  if (start < text.size()) encode_plain(text.substr(start), out);
  if (add_special_tokens) out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  Utf8Stream stream;
  std::string out;
  for (int64_t id : ids) {
    if (skip_special && is_special(id)) continue;
    out += stream.push(token_bytes(id));
  }
  return out + stream.flush();
}

std::string Utf8Stream::push(const std::string& bytes) {
  pending_ += bytes;
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    int len = utf8_length(pending_, i, nullptr);
    if (len == -1) break;   // an unfinished character: wait for the next token's bytes
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    out.append(pending_, i, static_cast<size_t>(len));
    i += static_cast<size_t>(len);
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Stream::flush() {
  std::string out;
  if (!pending_.empty()) out = "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

}  // namespace pocket
