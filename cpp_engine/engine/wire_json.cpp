// The protocol's JSON (wire_json.h).
#include "wire_json.h"

#include "../src/json.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace pocket {
namespace {

// Next code point of (possibly surrogate-carrying) UTF-8 at s[i]; advances i. Bad bytes read as U+FFFD.
uint32_t next_cp(const std::string& s, size_t& i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (len == 0 || i + len > s.size()) { ++i; return 0xFFFD; }
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

struct Reader {
  const std::string& s;
  size_t i = 0;
  int depth = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(what + " (at character " + std::to_string(i) + ")");
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  }
  uint32_t hex4() {
    if (i + 4 > s.size()) fail("a \\u escape is cut short");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      int digit = hex_digit(s[i++]);
      if (digit < 0) fail("a \\u escape holds a non-hex digit");
      v = (v << 4) | static_cast<uint32_t>(digit);
    }
    return v;
  }
  WireValue string_value() {
    WireValue v;
    v.kind = WireValue::Kind::String;
    ++i;   // the opening quote
    while (true) {
      if (i >= s.size()) fail("unterminated string");
      char c = s[i++];
      if (c == '"') return v;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') { v.text += c; continue; }
      if (i >= s.size()) fail("unterminated string");
      char e = s[i++];
      if (char plain = json_escape_char(e)) { v.text += plain; continue; }
      if (e != 'u') fail("an invalid escape");
      uint32_t cp = hex4();
      if (cp >= 0xD800 && cp < 0xDC00 && i + 6 <= s.size() && s[i] == '\\' && s[i + 1] == 'u') {
        size_t save = i;
        i += 2;
        uint32_t lo = hex4();
        if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        else i = save;   // not a pair: the high surrogate stays alone
      }
      if (cp >= 0xD800 && cp < 0xE000) v.lone_surrogate = true;
      append_utf8(v.text, cp);
    }
  }
  WireValue number_value() {
    size_t start = i;
    bool integral = true;
    if (s[i] == '-') ++i;
    if (i >= s.size() || !isdigit(static_cast<unsigned char>(s[i]))) fail("expecting a value");
    if (s[i] == '0') ++i;
    else while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
    if (i < s.size() && s[i] == '.') {
      size_t dot = ++i;
      while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
      if (i == dot) { i = dot - 1; return finish_number(start, true); }   // "1." is 1 then extra data
      integral = false;
    }
    if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
      size_t mark = i++;
      if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
      size_t digits = i;
      while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
      if (i == digits) i = mark;   // not an exponent: extra data follows
      else integral = false;
    }
    return finish_number(start, integral);
  }
  WireValue finish_number(size_t start, bool integral) {
    WireValue v;
    v.text = s.substr(start, i - start);
    v.number = std::strtod(v.text.c_str(), nullptr);
    if (integral) {
      v.kind = WireValue::Kind::Int;
      errno = 0;
      long long n = std::strtoll(v.text.c_str(), nullptr, 10);
      if (errno == ERANGE) v.big = true;
      v.integer = n;
    } else {
      v.kind = WireValue::Kind::Float;
    }
    return v;
  }
  WireValue value() {
    if (++depth > 512) fail("nested too deeply");
    ws();
    if (i >= s.size()) fail("expecting a value");
    WireValue v;
    char c = s[i];
    if (c == '{') {
      v.kind = WireValue::Kind::Object;
      ++i;
      ws();
      if (i < s.size() && s[i] == '}') { ++i; --depth; return v; }
      while (true) {
        ws();
        if (i >= s.size() || s[i] != '"') fail("expecting a property name in double quotes");
        std::string key = string_value().text;
        ws();
        if (i >= s.size() || s[i] != ':') fail("expecting ':' delimiter");
        ++i;
        v.set(key, value());
        ws();
        if (i < s.size() && s[i] == ',') { ++i; continue; }
        if (i < s.size() && s[i] == '}') { ++i; break; }
        fail("expecting ',' delimiter");
      }
    } else if (c == '[') {
      v.kind = WireValue::Kind::Array;
      ++i;
      ws();
      if (i < s.size() && s[i] == ']') { ++i; --depth; return v; }
      while (true) {
        v.items.push_back(value());
        ws();
        if (i < s.size() && s[i] == ',') { ++i; continue; }
        if (i < s.size() && s[i] == ']') { ++i; break; }
        fail("expecting ',' delimiter");
      }
    } else if (c == '"') {
      v = string_value();
    } else if (s.compare(i, 4, "true") == 0) {
      v.kind = WireValue::Kind::Bool; v.boolean = true; i += 4;
    } else if (s.compare(i, 5, "false") == 0) {
      v.kind = WireValue::Kind::Bool; i += 5;
    } else if (s.compare(i, 4, "null") == 0) {
      i += 4;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      if (s.compare(i, 9, "-Infinity") == 0) fail("-Infinity is not valid JSON");
      v = number_value();
    } else if (s.compare(i, 3, "NaN") == 0 || s.compare(i, 8, "Infinity") == 0) {
      fail(std::string(s.compare(i, 3, "NaN") == 0 ? "NaN" : "Infinity") + " is not valid JSON");
    } else {
      fail("expecting a value");
    }
    --depth;
    return v;
  }
};

void write_string(std::string& out, const std::string& text, bool ascii) {
  out += '"';
  size_t i = 0;
  char buf[16];
  while (i < text.size()) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (c < 0x20) { std::snprintf(buf, sizeof buf, "\\u%04x", c); out += buf; }
          else out += static_cast<char>(c);
      }
      continue;
    }
    size_t start = i;
    uint32_t cp = next_cp(text, i);
    if (!ascii) { out.append(text, start, i - start); continue; }
    if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
    }
    out += buf;
  }
  out += '"';
}

bool any_surrogate(const WireValue& v) {
  if (v.kind == WireValue::Kind::String) return v.lone_surrogate;
  for (const auto& item : v.items) if (any_surrogate(item)) return true;
  for (const auto& [key, item] : v.members) if (any_surrogate(item)) return true;
  return false;
}

void write(std::string& out, const WireValue& v, bool ascii) {
  switch (v.kind) {
    case WireValue::Kind::Null: out += "null"; break;
    case WireValue::Kind::Bool: out += v.boolean ? "true" : "false"; break;
    case WireValue::Kind::Int:
    case WireValue::Kind::Float: out += v.text; break;
    case WireValue::Kind::String: write_string(out, v.text, ascii); break;
    case WireValue::Kind::Array:
      out += '[';
      for (size_t k = 0; k < v.items.size(); ++k) {
        if (k) out += ',';
        write(out, v.items[k], ascii);
      }
      out += ']';
      break;
    case WireValue::Kind::Object:
      out += '{';
      for (size_t k = 0; k < v.members.size(); ++k) {
        if (k) out += ',';
        write_string(out, v.members[k].first, ascii);
        out += ':';
        write(out, v.members[k].second, ascii);
      }
      out += '}';
      break;
  }
}

std::string repr_string(const std::string& text) {
  bool has_single = text.find('\'') != std::string::npos, has_double = text.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  size_t i = 0;
  char buf[16];
  while (i < text.size()) {
    size_t start = i;
    uint32_t cp = next_cp(text, i);
    if (cp == '\\') out += "\\\\";
    else if (cp == static_cast<uint32_t>(quote)) { out += '\\'; out += quote; }
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (cp < 0x20 || cp == 0x7F) { std::snprintf(buf, sizeof buf, "\\x%02x", cp); out += buf; }
    else if (cp >= 0xD800 && cp < 0xE000) { std::snprintf(buf, sizeof buf, "\\u%04x", cp); out += buf; }
    else out.append(text, start, i - start);
  }
  out += quote;
  return out;
}

}  // namespace

const WireValue* WireValue::find(const std::string& key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& member : members)
    if (member.first == key) return &member.second;
  return nullptr;
}

WireValue& WireValue::set(const std::string& key, WireValue value) {
  for (auto& member : members)
    if (member.first == key) { member.second = std::move(value); return *this; }
  members.emplace_back(key, std::move(value));
  return *this;
}

WireValue WireValue::ms(double value) {
  WireValue v;
  v.kind = Kind::Float;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", value);
  v.text = buf;
  v.number = value;
  return v;
}

WireValue parse_wire(const std::string& text) {
  Reader reader{text};
  WireValue v = reader.value();
  reader.ws();
  if (reader.i != text.size()) reader.fail("extra data");
  return v;
}

std::string dump_wire(const WireValue& value) {
  std::string out;
  write(out, value, any_surrogate(value));
  return out;
}

std::string py_repr(const WireValue& v) {
  switch (v.kind) {
    case WireValue::Kind::Null: return "None";
    case WireValue::Kind::Bool: return v.boolean ? "True" : "False";
    case WireValue::Kind::Int: return v.text;
    case WireValue::Kind::Float: {
      if (std::isinf(v.number)) return v.number > 0 ? "inf" : "-inf";
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", v.number);
      for (int precision = 1; precision <= 17; ++precision) {   // the shortest form that reads back the same
        std::snprintf(buf, sizeof buf, "%.*g", precision, v.number);
        if (std::strtod(buf, nullptr) == v.number) break;
      }
      std::string out = buf;
      if (out.find_first_of(".en") == std::string::npos) out += ".0";
      return out;
    }
    case WireValue::Kind::String: return repr_string(v.text);
    case WireValue::Kind::Array: {
      std::string out = "[";
      for (size_t k = 0; k < v.items.size(); ++k) out += (k ? ", " : "") + py_repr(v.items[k]);
      return out + "]";
    }
    case WireValue::Kind::Object: {
      std::string out = "{";
      for (size_t k = 0; k < v.members.size(); ++k)
        out += (k ? ", " : "") + repr_string(v.members[k].first) + ": " + py_repr(v.members[k].second);
      return out + "}";
    }
  }
  return "";
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) { ++i; continue; }
    int len;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return false;
    if (i + len > s.size()) return false;
    for (int k = 1; k < len; ++k) {
      unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return false;
    i += len;
  }
  return true;
}

size_t code_point_count(const std::string& text) {
  size_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace pocket
