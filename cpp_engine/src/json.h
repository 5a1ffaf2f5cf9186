// A small JSON value with a parser and a writer: enough for config.json, safetensors headers and JSONL lines.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pocket {

struct Json {
  enum class Type { Null, Bool, Number, String, Array, Object };
  Type type = Type::Null;
  bool boolean = false;
  double number = 0.0;
  std::string string;
  std::vector<Json> array;
  std::map<std::string, Json> object;

  static Json parse(const std::string& text);  // throws std::runtime_error on malformed input
  std::string dump() const;

  bool is_null() const { return type == Type::Null; }
  bool is_number() const { return type == Type::Number; }
  bool is_string() const { return type == Type::String; }
  bool is_object() const { return type == Type::Object; }
  bool is_array() const { return type == Type::Array; }
  bool has(const std::string& key) const { return type == Type::Object && object.count(key) > 0; }
  const Json& at(const std::string& key) const;          // throws when absent
  const Json* find(const std::string& key) const;        // null when absent
  int64_t as_int() const;                                // throws unless an integral number
  double as_double() const;
  const std::string& as_string() const;

  static Json of(double v) { Json j; j.type = Type::Number; j.number = v; return j; }
  static Json of(int64_t v) { return of(static_cast<double>(v)); }
  static Json of(int v) { return of(static_cast<double>(v)); }
  static Json of(bool v) { Json j; j.type = Type::Bool; j.boolean = v; return j; }
  static Json of(const std::string& v) { Json j; j.type = Type::String; j.string = v; return j; }
  static Json of(const char* v) { return of(std::string(v)); }
  static Json obj() { Json j; j.type = Type::Object; return j; }
  static Json arr() { Json j; j.type = Type::Array; return j; }
  Json& set(const std::string& key, Json value) { object[key] = std::move(value); return *this; }
};

// Appends code point `cp` to `out` as UTF-8 (a surrogate's three-byte form included: the callers decide what
// a lone surrogate means).
void append_utf8(std::string& out, uint32_t cp);

// The character a one-letter JSON escape stands for (\" \\ \/ \b \f \n \r \t, given the letter after the
// backslash); 0 for any other letter (\u is the caller's).
char json_escape_char(char letter);

// The value of hex digit `c`, or -1 when it is not one.
int hex_digit(char c);

}  // namespace pocket
