// ChatML rendering (chat_template.h).
#include "chat_template.h"

#include <fstream>
#include <sstream>

#include "../src/json.h"

namespace pocket {
namespace {

bool read_text(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  out = buffer.str();
  return true;
}

// A Jinja string literal's escapes (\n, \t, \', \", \\) undone.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) { out += s[i]; continue; }
    char e = s[++i];
    out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
  }
  return out;
}

// Python's str.strip(): leading and trailing whitespace (ASCII, NEL, NBSP and the Unicode spaces) removed.
std::string strip(const std::string& text) {
  static const char* const kSpaces[] = {" ", "\t", "\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x1f",
                                        "\u0085", "\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003",
                                        "\u2004", "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200a",
                                        "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"};
  size_t begin = 0, end = text.size();
  bool changed = true;
  while (changed && begin < end) {
    changed = false;
    for (const char* space : kSpaces) {
      size_t n = std::char_traits<char>::length(space);
      if (end - begin >= n && text.compare(begin, n, space) == 0) { begin += n; changed = true; }
      if (end - begin >= n && text.compare(end - n, n, space) == 0) { end -= n; changed = true; }
    }
  }
  return text.substr(begin, end - begin);
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& checkpoint) {
  if (!read_text(checkpoint + "/chat_template.jinja", source_)) {
    std::string config;
    if (read_text(checkpoint + "/tokenizer_config.json", config)) {
      try {
        Json root = Json::parse(config);
        const Json* t = root.find("chat_template");
        if (t && t->is_string()) {
          source_ = t->as_string();
        } else if (t && t->is_array()) {
          for (const Json& named : t->array)
            if (named.has("name") && named.at("name").as_string() == "default") source_ = named.at("template").as_string();
        }
      } catch (const std::exception&) {
        source_.clear();
      }
    }
  }
  recognise();
}

ChatTemplate ChatTemplate::from_source(std::string source) {
  ChatTemplate chat;
  chat.source_ = std::move(source);
  chat.recognise();
  return chat;
}

void ChatTemplate::recognise() {
  chatml_ = source_.find("<|im_start|>") != std::string::npos && source_.find("<|im_end|>") != std::string::npos &&
            source_.find("message") != std::string::npos && source_.find("role") != std::string::npos &&
            source_.find("content") != std::string::npos;
  if (!chatml_) return;
  // A system prompt the template supplies when the conversation has none: a literal system turn (no
  // expression inside it) in a template that tests whether the first message is the system's.
  bool tests_system = source_.find("!= 'system'") != std::string::npos ||
                      source_.find("!= \"system\"") != std::string::npos ||
                      source_.find("== 'system'") != std::string::npos ||
                      source_.find("== \"system\"") != std::string::npos;
  const std::string head = "<|im_start|>system";
  for (size_t at = source_.find(head); tests_system && at != std::string::npos; at = source_.find(head, at + 1)) {
    size_t body = at + head.size();
    if (source_.compare(body, 1, "\n") == 0) body += 1;
    else if (source_.compare(body, 2, "\\n") == 0) body += 2;
    else continue;
    size_t end = source_.find("<|im_end|>", body);
    if (end == std::string::npos) break;
    std::string literal = source_.substr(body, end - body);
    if (literal.empty() || literal.find_first_of("'\"{}+") != std::string::npos) continue;
    has_default_system_ = true;
    default_system_ = unescape(literal);
    break;
  }
  // Qwen's templates trim message text ("| trim", Qwen3.5) and drop the thinking of earlier assistant turns
  // (content.split('</think>')[-1]).
  trim_ = source_.find("| trim") != std::string::npos;
  drop_thinking_ = source_.find("split('</think>')") != std::string::npos;
  // What the generation prompt adds after "<|im_start|>assistant\n" when the caller sets no enable_thinking:
  // Qwen3.5's template closes an empty think block unless thinking is asked for ("if enable_thinking is
  // defined and enable_thinking is true ... else '<think>\n\n</think>\n\n'"); Qwen3's adds nothing then.
  size_t prompt_at = source_.find("if add_generation_prompt");
  const std::string asks = "enable_thinking is defined and enable_thinking is true";
  size_t thinking = prompt_at == std::string::npos ? std::string::npos : source_.find(asks, prompt_at);
  if (thinking != std::string::npos) {
    size_t branch = source_.find("else", thinking);
    size_t open = branch == std::string::npos ? branch : source_.find_first_of("'\"", branch);
    if (open != std::string::npos) {
      size_t close = source_.find(source_[open], open + 1);
      if (close != std::string::npos) generation_suffix_ = unescape(source_.substr(open + 1, close - open - 1));
    }
  }
}

std::string ChatTemplate::refusal() const {
  if (!present())
    return "this model ships no chat template, so a conversation cannot be encoded for it; use generate with a "
           "prompt you render yourself";
  if (!chatml_)
    return "this model's chat template is not a ChatML template (<|im_start|>role ... <|im_end|>), the only kind "
           "pocketllm_engine renders without a Jinja interpreter; use generate with a prompt you render yourself";
  return "";
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages) const {
  std::string out;
  if (has_default_system_ && (messages.empty() || messages.front().role != "system"))
    out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
  size_t last_user = 0;
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_user = i;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    std::string content = trim_ ? strip(m.content) : m.content;
    if (drop_thinking_ && m.role == "assistant" && i < last_user) {
      size_t end = content.rfind("</think>");
      if (end != std::string::npos) {
        content.erase(0, end + 8);
        content.erase(0, content.find_first_not_of('\n') == std::string::npos ? content.size()
                                                                               : content.find_first_not_of('\n'));
      }
    }
    out += "<|im_start|>" + m.role + "\n" + content + "<|im_end|>\n";
  }
  return out + "<|im_start|>assistant\n" + generation_suffix_;
}

}  // namespace pocket
