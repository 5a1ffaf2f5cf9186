// The JSON parser and writer (json.h).
#include "json.h"

#include <cmath>
#include <cstdio>
#include <sstream>

namespace pocket {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

char json_escape_char(char letter) {
  switch (letter) {
    case '"': return '"';
    case '\\': return '\\';
    case '/': return '/';
    case 'b': return '\b';
    case 'f': return '\f';
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    default: return 0;
  }
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

namespace {

struct Parser {
  const std::string& s;
  size_t i = 0;
  int depth = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("invalid JSON at offset " + std::to_string(i) + ": " + what);
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  }
  bool lit(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s.compare(i, n, word) == 0) { i += n; return true; }
    return false;
  }
  uint32_t hex4() {
    if (i + 4 > s.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      int digit = hex_digit(s[i++]);
      if (digit < 0) fail("bad \\u escape");
      v = (v << 4) | static_cast<uint32_t>(digit);
    }
    return v;
  }
  std::string str() {
    if (s[i] != '"') fail("expected a string");
    ++i;
    std::string out;
    while (true) {
      if (i >= s.size()) fail("unterminated string");
      char c = s[i++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out += c; continue; }
      if (i >= s.size()) fail("unterminated escape");
      char e = s[i++];
      if (char plain = json_escape_char(e)) { out += plain; continue; }
      if (e != 'u') fail("bad escape");
      uint32_t cp = hex4();
      if (cp >= 0xD800 && cp < 0xDC00 && i + 6 <= s.size() && s[i] == '\\' && s[i + 1] == 'u') {
        i += 2;
        uint32_t lo = hex4();
        if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      }
      append_utf8(out, cp);
    }
  }
  Json value() {
    if (++depth > 256) fail("nested too deeply");
    ws();
    if (i >= s.size()) fail("unexpected end");
    Json j;
    char c = s[i];
    if (c == '{') {
      j.type = Json::Type::Object;
      ++i; ws();
      if (i < s.size() && s[i] == '}') { ++i; --depth; return j; }
      while (true) {
        ws();
        if (i >= s.size()) fail("unterminated object");
        std::string key = str();
        ws();
        if (i >= s.size() || s[i] != ':') fail("expected ':'");
        ++i;
        j.object[key] = value();
        ws();
        if (i < s.size() && s[i] == ',') { ++i; continue; }
        if (i < s.size() && s[i] == '}') { ++i; break; }
        fail("expected ',' or '}'");
      }
    } else if (c == '[') {
      j.type = Json::Type::Array;
      ++i; ws();
      if (i < s.size() && s[i] == ']') { ++i; --depth; return j; }
      while (true) {
        j.array.push_back(value());
        ws();
        if (i < s.size() && s[i] == ',') { ++i; continue; }
        if (i < s.size() && s[i] == ']') { ++i; break; }
        fail("expected ',' or ']'");
      }
    } else if (c == '"') {
      j.type = Json::Type::String;
      j.string = str();
    } else if (lit("true")) {
      j.type = Json::Type::Bool; j.boolean = true;
    } else if (lit("false")) {
      j.type = Json::Type::Bool;
    } else if (lit("null")) {
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t start = i;
      if (s[i] == '-') ++i;
      while (i < s.size() && (isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.' || s[i] == 'e' ||
                              s[i] == 'E' || s[i] == '+' || s[i] == '-')) ++i;
      std::string num = s.substr(start, i - start);
      char* end = nullptr;
      j.type = Json::Type::Number;
      j.number = std::strtod(num.c_str(), &end);
      if (end != num.c_str() + num.size()) fail("bad number");
    } else {
      fail("unexpected character");
    }
    --depth;
    return j;
  }
};

void write_string(std::string& out, const std::string& v) {
  out += '"';
  for (unsigned char c : v) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void write(std::string& out, const Json& j) {
  switch (j.type) {
    case Json::Type::Null: out += "null"; break;
    case Json::Type::Bool: out += j.boolean ? "true" : "false"; break;
    case Json::Type::Number: {
      if (std::isfinite(j.number) && j.number == std::floor(j.number) && std::fabs(j.number) < 1e15) {
        out += std::to_string(static_cast<int64_t>(j.number));
      } else if (std::isfinite(j.number)) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.9g", j.number);
        out += buf;
      } else {
        out += "null";
      }
      break;
    }
    case Json::Type::String: write_string(out, j.string); break;
    case Json::Type::Array: {
      out += '[';
      for (size_t k = 0; k < j.array.size(); ++k) {
        if (k) out += ',';
        write(out, j.array[k]);
      }
      out += ']';
      break;
    }
    case Json::Type::Object: {
      out += '{';
      bool first = true;
      for (const auto& [key, value] : j.object) {
        if (!first) out += ',';
        first = false;
        write_string(out, key);
        out += ':';
        write(out, value);
      }
      out += '}';
      break;
    }
  }
}

}  // namespace

Json Json::parse(const std::string& text) {
  Parser p{text};
  Json j = p.value();
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters");
  return j;
}

std::string Json::dump() const {
  std::string out;
  write(out, *this);
  return out;
}

const Json& Json::at(const std::string& key) const {
  const Json* j = find(key);
  if (!j) throw std::runtime_error("missing JSON key '" + key + "'");
  return *j;
}

const Json* Json::find(const std::string& key) const {
  if (type != Type::Object) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &it->second;
}

int64_t Json::as_int() const {
  if (type != Type::Number || number != std::floor(number)) throw std::runtime_error("expected an integer");
  return static_cast<int64_t>(number);
}

double Json::as_double() const {
  if (type != Type::Number) throw std::runtime_error("expected a number");
  return number;
}

const std::string& Json::as_string() const {
  if (type != Type::String) throw std::runtime_error("expected a string");
  return string;
}

}  // namespace pocket
