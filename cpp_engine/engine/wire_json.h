// The protocol's JSON: a strict parser of request lines (as Python's json.loads reads them, minus the NaN and
// Infinity constants the protocol refuses) and the writer of answer lines. Strings are kept as UTF-8 in which a
// lone surrogate from a \uD8xx escape is stored as its three-byte form (flagged, so that a writer escapes it).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pocket {

struct WireValue {
  enum class Kind { Null, Bool, Int, Float, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  std::string text;              // String: its UTF-8; Int/Float: the literal as written
  bool lone_surrogate = false;   // String: holds a lone surrogate
  int64_t integer = 0;           // Int (when it fits)
  bool big = false;              // Int: past int64
  double number = 0.0;           // Int or Float
  std::vector<WireValue> items;                              // Array
  std::vector<std::pair<std::string, WireValue>> members;    // Object (a repeated key: the last one wins)

  const WireValue* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }
  bool is_int() const { return kind == Kind::Int; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float; }

  static WireValue str(const std::string& s) { WireValue v; v.kind = Kind::String; v.text = s; return v; }
  static WireValue num(int64_t n) { WireValue v; v.kind = Kind::Int; v.integer = n; v.number = double(n); v.text = std::to_string(n); return v; }
  static WireValue ms(double value);   // a duration in ms, three decimals
  static WireValue flag(bool b) { WireValue v; v.kind = Kind::Bool; v.boolean = b; return v; }
  static WireValue object() { WireValue v; v.kind = Kind::Object; return v; }
  static WireValue array() { WireValue v; v.kind = Kind::Array; return v; }
  WireValue& set(const std::string& key, WireValue value);
};

// Throws std::runtime_error with what is wrong (the caller words the refusal).
WireValue parse_wire(const std::string& text);
// One answer line (no newline): non-ASCII characters raw, unless some string holds a lone surrogate, when every
// non-ASCII character is escaped (as Python's encode() does).
std::string dump_wire(const WireValue& value);
// Python's repr() of a value, for refusals that quote what they refuse.
std::string py_repr(const WireValue& value);
// Whether `bytes` is valid UTF-8 (no surrogates, no overlong forms).
bool valid_utf8(const std::string& bytes);
size_t code_point_count(const std::string& text);

}  // namespace pocket
