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
  for (const ChatMessage& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

}  // namespace pocket
