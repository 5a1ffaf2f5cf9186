// Chat rendering without a Jinja interpreter: the ChatML family of templates (Qwen's, SmolLM's) is recognised
// and rendered natively; any other template is refused.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace pocket {

struct ChatMessage {
  std::string role, content;
};

class ChatTemplate {
 public:
  // Reads chat_template.jinja, else tokenizer_config.json's chat_template, of a checkpoint directory.
  explicit ChatTemplate(const std::string& checkpoint);
  // A template's own text (a GGUF file's tokenizer.chat_template; empty: none).
  static ChatTemplate from_source(std::string source);
  bool present() const { return !source_.empty(); }
  bool chatml() const { return chatml_; }
  // Why chat is refused (empty when it is served).
  std::string refusal() const;
  std::string render(const std::vector<ChatMessage>& messages) const;   // with the assistant's generation prompt

 private:
  ChatTemplate() = default;
  void recognise();   // what the template renders, from source_
  std::string source_;
  bool chatml_ = false;
  bool has_default_system_ = false;
  std::string default_system_;
  std::string generation_suffix_;
  bool trim_ = false, drop_thinking_ = false;   // after "<|im_start|>assistant\n" (Qwen3.5: an empty think block)
};

}  // namespace pocket
