// pocketllm_engine: the harness's JSONL protocol (pocketllm/harness/PROTOCOL.md) over stdio, served by the
// native engine without Python. One JSON object per line in on stdin, id-tagged answers on stdout, logs on
// stderr. A reader thread (this one) parses lines; the batch scheduler's thread streams tokens back.
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../src/batch_scheduler.h"
#include "../src/gguf.h"
#include "../src/json.h"
#include "../src/qwen_engine.h"
#include "bpe_tokenizer.h"
#include "chat_template.h"
#include "wire_json.h"

namespace pocket {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxLineBytes = 8u << 20;   // the newline not counted (protocol.py's MAX_LINE_BYTES, LINE_TOO_LONG)
const std::string kLineTooLong =
    "the line is longer than " + std::to_string(kMaxLineBytes) + " bytes (8 MiB), the protocol's limit; it was not read";
constexpr size_t kMaxIdChars = 128;
constexpr size_t kMaxStops = 16;
const char* const kOps[] = {"generate", "chat", "health", "cancel", "open", "close", "auth", "shutdown"};
const char* const kSampling[] = {"n", "temp", "top_k", "top_p", "repeat_penalty", "seed", "stop"};

struct Refusal {
  std::string message;
  bool has_id;
  WireValue id;
};

double ms_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double, std::milli>(now - t).count();
}

// --- output ---------------------------------------------------------------------------------------
int g_out_fd = 1;
int g_wake_fd = -1;   // a byte written here wakes the reader (a signal, a failed load)

void wake_reader() {
  if (g_wake_fd >= 0) {
    ssize_t ignored = ::write(g_wake_fd, "x", 1);
    (void)ignored;
  }
}
std::mutex g_out_mutex;
bool g_verbose = false;

void send(const WireValue& line) {
  std::string text = dump_wire(line);
  text += '\n';
  std::lock_guard<std::mutex> guard(g_out_mutex);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(g_out_fd, text.data() + done, text.size() - done);
    if (n <= 0) return;   // the reader went away; nothing more can be said
    done += static_cast<size_t>(n);
  }
}

void send_error(const std::string& message, const WireValue* id) {
  WireValue line = WireValue::object();
  line.set("id", id ? *id : WireValue()).set("error", WireValue::str(message));
  send(line);
}

void log(const std::string& level, const std::string& text) {
  if (level == "DEBUG" && !g_verbose) return;
  std::fprintf(stderr, "pocketllm_engine %s: %s\n", level.c_str(), text.c_str());
  std::fflush(stderr);
}

// --- requests and sessions ------------------------------------------------------------------------
struct Session {
  std::string sid;
  std::string kind;                  // "", "text" or "chat"
  std::string text;
  std::vector<ChatMessage> messages;
  std::string busy_key;              // the running request's key, "" when idle
  bool closed = false;
};

struct Request {
  std::mutex mutex;
  WireValue id;
  std::string key;
  std::string kind;                  // "text" or "chat"
  WireValue fields;                  // the validated request object
  std::shared_ptr<Session> session;
  std::string engine_id;
  bool cancelled = false, stopped = false, finished = false;
  std::vector<std::string> stops;
  size_t longest_stop = 0;
  Utf8Stream utf8;
  std::string text;                  // decoded so far
  size_t sent = 0;                   // bytes of text already sent
  std::string new_text_state;        // the session's text (prompt included) this turn continues
  std::vector<ChatMessage> new_messages;
  Clock::time_point submitted, first_token;
  bool has_first = false;
};

std::string request_key(const WireValue& id) { return (id.is_string() ? "s:" : "i:") + id.text; }

// The text side of a model: its tokenizer and chat template, from a checkpoint directory's files or from a
// .gguf file's tokenizer.* metadata.
struct TextSide {
  std::unique_ptr<BpeTokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat;
};

TextSide open_text_side(const std::string& model) {
  TextSide side;
  if (is_gguf_path(model)) {
    GgufFile file(model);
    side.tokenizer = std::make_unique<BpeTokenizer>(BpeTokenizer::from_gguf(file));
    side.chat = std::make_unique<ChatTemplate>(ChatTemplate::from_source(file.string_or("tokenizer.chat_template", "")));
  } else {
    side.tokenizer = std::make_unique<BpeTokenizer>(model + "/tokenizer.json");
    side.chat = std::make_unique<ChatTemplate>(model);
  }
  return side;
}

struct Defaults {
  double temperature = 0.8, top_p = 0.95, repetition_penalty = 1.0;
  int64_t top_k = 40;
};

class Server {
 public:
  Server(std::string model, QwenEngineOptions options, int64_t max_seqs)
      : model_(std::move(model)), options_(options), max_seqs_(max_seqs) {}

  void load() {
    try {
      checkpoint_config(model_);   // refuses an unsupported model before anything else is read
      TextSide text = open_text_side(model_);
      Defaults defaults = read_generation_config();
      auto engine = std::make_unique<QwenEngine>(model_, options_);
      auto scheduler = std::make_unique<QwenBatchScheduler>(*engine, max_seqs_);
      std::vector<std::shared_ptr<Request>> deferred;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        tokenizer_ = std::move(text.tokenizer);
        chat_ = std::move(text.chat);
        defaults_ = defaults;
        engine_ = std::move(engine);
        scheduler_ = std::move(scheduler);
        state_ = "ready";
        deferred.swap(deferred_);
      }
      log("INFO", "model ready: " + model_ + " (" + engine_->config().architecture + ", context " +
                      std::to_string(engine_->max_model_len()) + ")");
      for (auto& request : deferred) start(request);
    } catch (const std::exception& err) {
      std::vector<std::shared_ptr<Request>> deferred;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        state_ = "failed";
        load_error_ = err.what();
        deferred.swap(deferred_);
      }
      log("ERROR", std::string("the model failed to load: ") + err.what());
      for (auto& request : deferred) finish_with_error(request, "the model failed to load: " + load_error_);
      stop_reading_ = true;
      wake_reader();
    }
  }

  bool failed() {
    std::lock_guard<std::mutex> guard(mutex_);
    return state_ == "failed";
  }
  std::string load_error() {
    std::lock_guard<std::mutex> guard(mutex_);
    return load_error_;
  }
  bool stop_reading() const { return stop_reading_; }

  // SIGTERM or SIGINT: no new requests, nothing more read; what runs finishes.
  void begin_stop() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!draining_) log("INFO", "draining: " + std::to_string(requests_.size()) + " request(s) in flight");
    draining_ = true;
    stop_reading_ = true;
  }

  void handle(const std::string& line) {
    WireValue request;
    std::string op;
    try {
      request = parse_line(line, op);
    } catch (const Refusal& r) {
      refuse(r.message, r.has_id ? &r.id : nullptr);
      return;
    }
    const WireValue* id = request.find("id");
    try {
      if (op != "cancel" && id && running(*id)) throw Refusal{op + " refused: send it with another id", false, {}};
      if (op == "health") op_health(id);
      else if (op == "auth") throw Refusal{"auth is for host connections; the pipe needs no token", false, {}};
      else if (op == "shutdown") op_shutdown(id);
      else if (op == "cancel") op_cancel(*id);
      else if (op == "open") op_open(request, id);
      else if (op == "close") op_close(request, id);
      else op_generate(request, op == "chat" ? "chat" : "text");
    } catch (const Refusal& r) {
      refuse(r.message, id);
    } catch (const std::exception& err) {
      refuse(std::string("internal error: ") + err.what(), id);
    }
  }

  // The error answering a line just read: tagged with its id, unless a request still running holds that id; then
  // untagged and naming the id, so that it cannot be taken for that request's end (service.py's _refuse).
  void refuse(std::string message, const WireValue* id) {
    if (id && running(*id)) {
      message += " (the line's id " + py_repr(*id) + " belongs to a request still running)";
      id = nullptr;
    }
    send_error(message, id);
  }

  bool running(const WireValue& id) {
    std::lock_guard<std::mutex> guard(mutex_);
    return requests_.count(request_key(id)) > 0;
  }

  // Waits for the load, then for every running request; stops the scheduler.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    draining_ = true;
    idle_.wait(lock, [&] { return state_ != "loading" && requests_.empty(); });
    auto scheduler = std::move(scheduler_);
    lock.unlock();
    if (scheduler) scheduler->stop();
  }

 private:
  // --- parsing (pocketllm/harness/protocol.py's parse_line) ----------------------------------------
  static WireValue parse_line(const std::string& line, std::string& op_name) {
    if (!valid_utf8(line)) throw Refusal{"the line is not valid UTF-8", false, {}};
    WireValue obj;
    try {
      obj = parse_wire(line);
    } catch (const std::exception& err) {
      throw Refusal{std::string("the line is not valid JSON: ") + err.what(), false, {}};
    }
    if (obj.kind != WireValue::Kind::Object)
      throw Refusal{"each line must be a JSON object like {\"op\": \"generate\", \"id\": 1, ...}", false, {}};
    const WireValue* id = obj.find("id");
    if (id) {
      if (!(id->is_int() || id->is_string())) throw Refusal{"id must be an integer or a string", false, {}};
      if (id->is_string() && (id->text.empty() || code_point_count(id->text) > kMaxIdChars))
        throw Refusal{"a string id must have 1 to " + std::to_string(kMaxIdChars) + " characters", false, {}};
    }
    auto refuse = [&](const std::string& message) { return Refusal{message, id != nullptr, id ? *id : WireValue()}; };
    const WireValue* op = obj.find("op");
    bool known = false;
    if (op && op->is_string())
      for (const char* name : kOps) known = known || op->text == name;
    if (!known) {
      std::string ops;
      for (const char* name : kOps) ops += (ops.empty() ? "" : ", ") + std::string(name);
      throw refuse("unknown op " + (op ? py_repr(*op) : std::string("None")) + "; the ops are " + ops);
    }
    op_name = op->text;
    if ((op_name == "generate" || op_name == "chat" || op_name == "cancel") && !id) {
      std::string what = op_name == "cancel" ? "the request to cancel" : "this request and its answers";
      throw Refusal{op_name + " needs an 'id' naming " + what, false, {}};
    }
    std::vector<std::string> allowed;
    if (op_name == "generate" || op_name == "chat") {
      allowed = {op_name == "generate" ? "prompt" : "messages", "session", "diag"};
      for (const char* name : kSampling) allowed.push_back(name);
    } else if (op_name == "open") {
      allowed = {"session", "messages"};
    } else if (op_name == "close") {
      allowed = {"session"};
    } else if (op_name == "auth") {
      allowed = {"token"};
    }
    std::vector<std::string> unknown;
    for (const auto& [key, value] : obj.members) {
      bool ok = key == "op" || key == "id";
      for (const auto& name : allowed) ok = ok || key == name;
      if (!ok) unknown.push_back(key);
    }
    if (!unknown.empty()) {
      std::sort(unknown.begin(), unknown.end());
      std::string names, accepted;
      for (const auto& key : unknown) names += (names.empty() ? "" : ", ") + py_repr(WireValue::str(key));
      for (const auto& key : allowed) accepted += (accepted.empty() ? "" : ", ") + key;
      if (accepted.empty()) accepted = "no fields besides op and id";
      throw refuse("unknown field(s) " + names + " for op " + py_repr(*op) + " (it takes: " + accepted + ")");
    }
    try {
      validate(op_name, obj);
    } catch (const std::invalid_argument& err) {
      throw refuse(err.what());
    }
    return obj;
  }

  static void check_unicode(const std::string& name, const WireValue& text) {
    if (text.lone_surrogate) throw std::invalid_argument(name + " is not valid Unicode (it holds a lone surrogate)");
  }

  static void check_messages(const WireValue* messages) {
    const std::string name = "messages";
    if (!messages || messages->kind != WireValue::Kind::Array || messages->items.empty())
      throw std::invalid_argument(name + " must be a non-empty list of {\"role\", \"content\"} objects");
    for (size_t i = 0; i < messages->items.size(); ++i) {
      const WireValue& m = messages->items[i];
      const std::string at = name + "[" + std::to_string(i) + "]";
      if (m.kind != WireValue::Kind::Object) throw std::invalid_argument(at + " must be an object");
      std::vector<std::string> extra;
      for (const auto& [key, value] : m.members)
        if (key != "role" && key != "content") extra.push_back(key);
      if (!extra.empty()) {
        std::sort(extra.begin(), extra.end());
        std::string names;
        for (const auto& key : extra) names += (names.empty() ? "" : ", ") + py_repr(WireValue::str(key));
        throw std::invalid_argument(at + " has unknown field(s) " + names +
                                    " (a message has only 'role' and 'content')");
      }
      const WireValue* role = m.find("role");
      const WireValue* content = m.find("content");
      if (!role || !role->is_string() || (role->text != "system" && role->text != "user" && role->text != "assistant"))
        throw std::invalid_argument(at + ".role must be one of system, user, assistant");
      if (!content || !content->is_string()) throw std::invalid_argument(at + ".content must be a string");
      check_unicode(at + ".content", *content);
    }
  }

  static bool valid_session_id(const WireValue& v) {
    if (!v.is_string() || v.text.empty() || v.text.size() > 64) return false;
    for (size_t k = 0; k < v.text.size(); ++k) {
      char c = v.text[k];
      bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
      if (!alnum && (k == 0 || (c != '_' && c != '-'))) return false;
    }
    return true;
  }

  static void validate(const std::string& op, const WireValue& obj) {
    if (const WireValue* s = obj.find("session"); s && !valid_session_id(*s))
      throw std::invalid_argument("session must be 1 to 64 letters, digits, '_' or '-', starting with a letter or digit");
    if (const WireValue* d = obj.find("diag"); d && d->kind != WireValue::Kind::Bool)
      throw std::invalid_argument("diag must be true or false");
    if (op == "generate") {
      const WireValue* prompt = obj.find("prompt");
      if (!prompt || !prompt->is_string() || prompt->text.empty())
        throw std::invalid_argument("generate needs a non-empty string 'prompt'");
      check_unicode("prompt", *prompt);
    } else if (op == "chat") {
      if (!obj.has("messages")) throw std::invalid_argument("chat needs 'messages'");
      check_messages(obj.find("messages"));
    } else if (op == "open") {
      if (obj.has("messages")) check_messages(obj.find("messages"));
    } else if (op == "close") {
      if (!obj.has("session")) throw std::invalid_argument("close needs the 'session' to close");
    } else if (op == "auth") {
      const WireValue* token = obj.find("token");
      if (!token || !token->is_string()) throw std::invalid_argument("auth needs a string 'token'");
    }
    auto integer = [](const std::string& name, const WireValue& v) {
      if (!v.is_int()) throw std::invalid_argument(name + " must be an integer, got " + py_repr(v));
    };
    auto finite = [](const std::string& name, const WireValue& v) {
      if (!v.is_number() || !std::isfinite(v.number))
        throw std::invalid_argument(name + " must be a finite number, got " + py_repr(v));
      return v.number;
    };
    if (const WireValue* n = obj.find("n")) {
      integer("n", *n);
      if ((n->big && n->text[0] == '-') || n->integer == 0 || n->integer < -1)
        throw std::invalid_argument("n must be a positive token budget, or -1 for 'until the context is full'; got " +
                                    n->text);
    }
    if (const WireValue* t = obj.find("temp"); t && finite("temp", *t) < 0)
      throw std::invalid_argument("temp must be >= 0 (0 is greedy)");
    if (const WireValue* k = obj.find("top_k")) {
      integer("top_k", *k);
      if (k->text[0] == '-' && k->number != 0) throw std::invalid_argument("top_k must be >= 0, got " + k->text);
    }
    if (const WireValue* p = obj.find("top_p")) {
      double v = finite("top_p", *p);
      if (!(v > 0 && v <= 1)) throw std::invalid_argument("top_p must be in (0, 1]");
    }
    if (const WireValue* r = obj.find("repeat_penalty"); r && !(finite("repeat_penalty", *r) > 0))
      throw std::invalid_argument("repeat_penalty must be > 0 (1 is off)");
    if (const WireValue* s = obj.find("seed")) integer("seed", *s);
    if (const WireValue* stop = obj.find("stop")) {
      std::vector<const WireValue*> stops;
      bool ok = true;
      if (stop->is_string()) stops.push_back(stop);
      else if (stop->kind == WireValue::Kind::Array) for (const auto& s : stop->items) stops.push_back(&s);
      else ok = false;
      for (const WireValue* s : stops) ok = ok && s->is_string() && !s->text.empty();
      if (!ok) throw std::invalid_argument("stop must be a non-empty string or a list of non-empty strings");
      if (stops.size() > kMaxStops)
        throw std::invalid_argument("stop takes at most " + std::to_string(kMaxStops) + " strings");
      for (const WireValue* s : stops) check_unicode("stop", *s);
    }
  }

  // --- ops ------------------------------------------------------------------------------------
  void op_health(const WireValue* id) {
    std::string state;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      state = state_;
    }
    WireValue line = WireValue::object();
    line.set("id", id ? *id : WireValue()).set("state", WireValue::str(state)).set("model", WireValue::str(model_));
    send(line);
  }

  void op_shutdown(const WireValue* id) {
    size_t running;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      running = requests_.size();
      draining_ = true;
    }
    WireValue line = WireValue::object();
    line.set("id", id ? *id : WireValue()).set("state", WireValue::str("draining"))
        .set("running", WireValue::num(static_cast<int64_t>(running)));
    send(line);
    log("INFO", "draining: " + std::to_string(running) + " request(s) in flight");
    stop_reading_ = true;
  }

  void op_cancel(const WireValue& id) {
    std::shared_ptr<Request> request;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = requests_.find(request_key(id));
      if (it != requests_.end()) request = it->second;
    }
    if (!request) throw Refusal{"no running request with id " + py_repr(id), false, {}};
    cancel(request);
  }

  void cancel(const std::shared_ptr<Request>& request) {
    std::lock_guard<std::mutex> guard(request->mutex);
    request->cancelled = true;
    if (!request->engine_id.empty() && scheduler_) scheduler_->cancel(request->engine_id);
  }

  void op_open(const WireValue& obj, const WireValue* id) {
    std::lock_guard<std::mutex> guard(mutex_);
    std::string sid;
    if (const WireValue* s = obj.find("session")) {
      sid = s->text;
    } else {
      static std::mt19937_64 rng{std::random_device{}()};
      char buf[16];
      std::snprintf(buf, sizeof buf, "%012llx", static_cast<unsigned long long>(rng() & 0xFFFFFFFFFFFFULL));
      sid = buf;
    }
    auto it = sessions_.find(sid);
    bool resumed = it != sessions_.end();
    std::shared_ptr<Session> session = resumed ? it->second : std::make_shared<Session>();
    if (const WireValue* messages = obj.find("messages")) {
      if (!session->busy_key.empty())
        throw Refusal{"session " + py_repr(WireValue::str(sid)) + " is busy with request " +
                          session->busy_key.substr(2), false, {}};
      session->kind = "chat";
      session->messages = to_messages(*messages);
    }
    session->sid = sid;
    sessions_[sid] = session;
    WireValue line = WireValue::object();
    line.set("id", id ? *id : WireValue()).set("session", WireValue::str(sid)).set("resumed", WireValue::flag(resumed));
    if (session->kind == "chat") line.set("messages", messages_value(session->messages));
    else if (session->kind == "text") line.set("text", WireValue::str(session->text));
    send(line);
  }

  void op_close(const WireValue& obj, const WireValue* id) {
    const std::string sid = obj.find("session")->text;
    std::vector<std::shared_ptr<Request>> to_cancel;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = sessions_.find(sid);
      if (it == sessions_.end()) throw Refusal{"unknown session " + py_repr(WireValue::str(sid)), false, {}};
      it->second->closed = true;
      for (auto& [key, request] : requests_)
        if (request->session == it->second) to_cancel.push_back(request);
      sessions_.erase(it);
    }
    for (auto& request : to_cancel) cancel(request);
    WireValue line = WireValue::object();
    line.set("id", id ? *id : WireValue()).set("session", WireValue::str(sid)).set("closed", WireValue::flag(true));
    send(line);
  }

  static std::vector<ChatMessage> to_messages(const WireValue& messages) {
    std::vector<ChatMessage> out;
    for (const WireValue& m : messages.items) out.push_back({m.find("role")->text, m.find("content")->text});
    return out;
  }
  static WireValue messages_value(const std::vector<ChatMessage>& messages) {
    WireValue list = WireValue::array();
    for (const auto& m : messages) {
      WireValue item = WireValue::object();
      item.set("role", WireValue::str(m.role)).set("content", WireValue::str(m.content));
      list.items.push_back(item);
    }
    return list;
  }

  void op_generate(const WireValue& obj, const std::string& kind) {
    auto request = std::make_shared<Request>();
    request->id = *obj.find("id");
    request->key = request_key(request->id);
    request->kind = kind;
    request->fields = obj;
    bool defer;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (draining_) throw Refusal{"the harness is shutting down and takes no new requests", false, {}};
      if (state_ == "failed") throw Refusal{"the model failed to load: " + load_error_, false, {}};
      if (const WireValue* s = obj.find("session")) {
        auto it = sessions_.find(s->text);
        const std::string quoted = py_repr(*s);
        if (it == sessions_.end())
          throw Refusal{"session " + quoted + " is not open on this connection; send open first", false, {}};
        Session& session = *it->second;
        if (!session.busy_key.empty())
          throw Refusal{"session " + quoted + " is busy with request " + session.busy_key.substr(2), false, {}};
        if (!session.kind.empty() && session.kind != kind)
          throw Refusal{"session " + quoted + " holds a " + session.kind + " conversation; use " +
                            (session.kind == "chat" ? "chat" : "generate"), false, {}};
        session.busy_key = request->key;
        request->session = it->second;
      }
      requests_[request->key] = request;
      defer = state_ == "loading";
      if (defer) deferred_.push_back(request);
    }
    if (!defer) start(request);
  }

  // Encodes the prompt and submits it (on the reader thread, or the loader's for requests sent while loading).
  void start(const std::shared_ptr<Request>& request) {
    try {
      {
        std::lock_guard<std::mutex> guard(request->mutex);
        if (request->cancelled) {
          request->finished = true;
          WireValue usage = WireValue::object();
          usage.set("prompt_tokens", WireValue::num(0)).set("gen_tokens", WireValue::num(0))
              .set("prefill_ms", WireValue::ms(0)).set("decode_ms", WireValue::ms(0));
          WireValue done = WireValue::object();
          done.set("id", request->id).set("done", WireValue::flag(true)).set("finish", WireValue::str("cancel"))
              .set("usage", usage);
          retire(request);
          send(done);
          return;
        }
      }
      const WireValue& obj = request->fields;
      std::string prompt_text;
      bool add_special = request->kind == "text";
      if (request->kind == "text") {
        request->new_text_state = (request->session ? request->session->text : "") + obj.find("prompt")->text;
        prompt_text = request->new_text_state;
      } else {
        std::string why = chat_->refusal();
        if (!why.empty()) throw Refusal{why, false, {}};
        if (request->session) request->new_messages = request->session->messages;
        for (const auto& m : to_messages(*obj.find("messages"))) request->new_messages.push_back(m);
        prompt_text = chat_->render(request->new_messages);
      }
      const int64_t limit = engine_->max_model_len();
      const int64_t most = tokenizer_->max_token_bytes();
      if (most > 0) check_fits(limit, (static_cast<int64_t>(prompt_text.size()) + most - 1) / most, "at least ");
      std::vector<int64_t> prompt = tokenizer_->encode(prompt_text, add_special);
      const int64_t prompt_len = static_cast<int64_t>(prompt.size());
      check_fits(limit, prompt_len, "");
      if (prompt.empty()) throw Refusal{"the prompt encodes to no tokens", false, {}};
      SamplingOptions sampling;
      sampling.temperature = defaults_.temperature;
      sampling.top_k = defaults_.top_k;
      sampling.top_p = defaults_.top_p;
      sampling.repetition_penalty = defaults_.repetition_penalty;
      if (const WireValue* v = obj.find("temp")) sampling.temperature = v->number;
      if (const WireValue* v = obj.find("top_k")) sampling.top_k = v->integer;
      if (const WireValue* v = obj.find("top_p")) sampling.top_p = v->number;
      if (const WireValue* v = obj.find("repeat_penalty")) sampling.repetition_penalty = v->number;
      if (const WireValue* v = obj.find("seed")) {
        if (v->big) throw Refusal{"seed is out of range for this engine (a 64-bit integer)", false, {}};
        sampling.seed = v->integer < 0 ? static_cast<int64_t>(static_cast<uint64_t>(v->integer) >> 1) : v->integer;
      }
      const int64_t room = limit - prompt_len;
      const WireValue* n = obj.find("n");
      sampling.max_new_tokens = (!n || n->integer == -1 || n->big) ? room : std::min(n->integer, room);
      if (const WireValue* stop = obj.find("stop")) {
        if (stop->is_string()) request->stops.push_back(stop->text);
        else for (const auto& s : stop->items) request->stops.push_back(s.text);
        for (const auto& s : request->stops) request->longest_stop = std::max(request->longest_stop, s.size());
      }
      std::lock_guard<std::mutex> guard(request->mutex);
      request->submitted = Clock::now();
      request->engine_id = scheduler_->submit(
          prompt, sampling,
          [this, request](const BatchResult& result) { on_done(request, result); },
          [this, request](const std::string&, int64_t token) { on_token(request, token); });
      log("DEBUG", "request " + py_repr(request->id) + ": " + std::to_string(prompt_len) + " prompt tokens, as " +
                       request->engine_id);
    } catch (const Refusal& r) {
      finish_with_error(request, r.message);
    } catch (const std::exception& err) {
      finish_with_error(request, err.what());
    }
  }

  static void check_fits(int64_t limit, int64_t prompt_len, const std::string& bound) {
    if (limit - prompt_len < 1)
      throw Refusal{"the prompt is " + bound + std::to_string(prompt_len) + " tokens and the context is " +
                        std::to_string(limit) + " (--ctx); shorten it or start a new session", false, {}};
  }

  void finish_with_error(const std::shared_ptr<Request>& request, const std::string& message) {
    {
      std::lock_guard<std::mutex> guard(request->mutex);
      request->finished = true;
    }
    retire(request);
    send_error(message, &request->id);
  }

  // Forgets a finished request (its id may be used again) and frees its session.
  void retire(const std::shared_ptr<Request>& request) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = requests_.find(request->key);
    if (it != requests_.end() && it->second == request) requests_.erase(it);
    if (request->session && request->session->busy_key == request->key) request->session->busy_key.clear();
    idle_.notify_all();
  }

  void emit_chunk(Request& request, size_t upto) {
    if (upto <= request.sent) return;
    WireValue line = WireValue::object();
    line.set("id", request.id).set("chunk", WireValue::str(request.text.substr(request.sent, upto - request.sent)));
    request.sent = upto;
    send(line);
  }

  // Text past what was sent that could still begin a stop string is held back.
  size_t releasable(const Request& request) const {
    const std::string& text = request.text;
    size_t hold = 0;
    for (const auto& stop : request.stops) {
      for (size_t len = std::min(stop.size() - 1, text.size() - request.sent); len > hold; --len) {
        if (text.compare(text.size() - len, len, stop, 0, len) == 0) { hold = len; break; }
      }
    }
    return text.size() - hold;
  }

  void on_token(const std::shared_ptr<Request>& request, int64_t token) {
    std::lock_guard<std::mutex> guard(request->mutex);
    if (request->stopped || request->finished) return;
    if (!request->has_first) {
      request->has_first = true;
      request->first_token = Clock::now();
    }
    if (tokenizer_->is_special(token)) return;
    request->text += request->utf8.push(tokenizer_->token_bytes(token));
    if (!request->stops.empty()) {
      size_t from = request->sent;
      size_t best = std::string::npos;
      for (const auto& stop : request->stops) {
        size_t at = request->text.find(stop, from);
        if (at != std::string::npos && at < best) best = at;
      }
      if (best != std::string::npos) {
        emit_chunk(*request, best);
        request->text.resize(best);
        request->stopped = true;
        scheduler_->cancel(request->engine_id);
        return;
      }
    }
    emit_chunk(*request, releasable(*request));
  }

  void on_done(const std::shared_ptr<Request>& request, const BatchResult& result) {
    WireValue done = WireValue::object();
    {
      std::lock_guard<std::mutex> guard(request->mutex);
      request->finished = true;
      auto now = Clock::now();
      if (!request->has_first) request->first_token = now;
      if (result.finish_reason == "error") {
        done.set("id", request->id).set("error", WireValue::str(result.error));
      } else {
        if (!request->stopped) {
          request->text += request->utf8.flush();
          emit_chunk(*request, request->text.size());
        }
        std::string finish = request->stopped ? "stop"
                             : request->cancelled || result.finish_reason == "cancelled" ? "cancel"
                             : result.finish_reason == "length" ? "budget" : "eos";
        WireValue usage = WireValue::object();
        usage.set("prompt_tokens", WireValue::num(result.prompt_tokens))
            .set("gen_tokens", WireValue::num(result.completion_tokens))
            .set("prefill_ms", WireValue::ms(ms_since(request->submitted, request->first_token)))
            .set("decode_ms", WireValue::ms(ms_since(request->first_token, now)));
        done.set("id", request->id).set("done", WireValue::flag(true)).set("finish", WireValue::str(finish))
            .set("usage", usage);
        if (const WireValue* diag = request->fields.find("diag"); diag && diag->boolean)
          done.set("diag", diag_value(*request, result));
        advance_session(*request);
      }
    }
    retire(request);
    send(done);
  }

  void advance_session(Request& request) {
    std::lock_guard<std::mutex> guard(mutex_);
    Session* session = request.session.get();
    if (!session || session->closed) return;
    session->kind = request.kind;
    if (request.kind == "text") {
      session->text = request.new_text_state + request.text;
    } else {
      session->messages = request.new_messages;
      session->messages.push_back({"assistant", request.text});
    }
  }

  WireValue diag_value(const Request& request, const BatchResult& result) const {
    const int64_t prompt = result.prompt_tokens, cached = result.cached_tokens;
    WireValue route = WireValue::object();
    route.set("backend", WireValue::str("native")).set("device", WireValue::str(engine_->device()))
        .set("dtype", WireValue::str("float32")).set("architecture", WireValue::str(engine_->config().architecture))
        .set("format", WireValue::str(is_gguf_path(model_) ? "gguf" : "safetensors"));
    WireValue prefill = WireValue::object();
    prefill.set("mode", WireValue::str(cached ? "prefix-cached" : "cold"))
        .set("chunked", WireValue::flag(prompt - cached > 512))
        .set("prompt_tokens", WireValue::num(prompt)).set("cached_tokens", WireValue::num(cached))
        .set("computed_tokens", WireValue::num(prompt - cached));
    WireValue prefix = WireValue::object();
    WireValue rate = WireValue::ms(static_cast<double>(cached) / static_cast<double>(std::max<int64_t>(1, prompt)));
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f", rate.number);
    rate.text = buf;
    prefix.set("hit_tokens", WireValue::num(cached)).set("hit_rate", rate);
    WireValue diag = WireValue::object();
    diag.set("route", route).set("prefill", prefill).set("prefix_cache", prefix).set("queue_ms", WireValue::ms(0));
    if (request.session) diag.set("session", WireValue::str(request.session->sid));
    return diag;
  }

  Defaults read_generation_config() const {
    Defaults d;
    if (is_gguf_path(model_)) return d;   // a GGUF file carries no generation config
    std::ifstream in(model_ + "/generation_config.json");
    if (!in) return d;
    std::ostringstream buffer;
    buffer << in.rdbuf();
    Json config = Json::parse(buffer.str());
    auto number = [&](const char* key, double& out) {
      const Json* v = config.find(key);
      if (v && v->is_number()) out = v->number;
    };
    number("temperature", d.temperature);
    number("top_p", d.top_p);
    number("repetition_penalty", d.repetition_penalty);
    if (const Json* k = config.find("top_k"); k && k->is_number()) d.top_k = static_cast<int64_t>(k->number);
    if (const Json* s = config.find("do_sample"); s && s->type == Json::Type::Bool && !s->boolean) d.temperature = 0;
    return d;
  }

  const std::string model_;
  const QwenEngineOptions options_;
  const int64_t max_seqs_;
  std::mutex mutex_;
  std::condition_variable idle_;
  std::string state_ = "loading";
  std::string load_error_;
  bool draining_ = false;
  std::atomic<bool> stop_reading_{false};
  std::unique_ptr<BpeTokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_;
  Defaults defaults_;
  std::unique_ptr<QwenEngine> engine_;
  std::unique_ptr<QwenBatchScheduler> scheduler_;
  std::map<std::string, std::shared_ptr<Request>> requests_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::shared_ptr<Request>> deferred_;
};

const char* kUsage =
    "usage: pocketllm_engine --model DIR|FILE.gguf [--ctx N] [--max-seqs N] [--kv-cache-mb MB] [--threads N]\n"
    "                        [--weight-format auto|float32] [--device auto|cpu|cuda] [--verbose]\n"
    "Serves the harness's JSONL protocol (see pocketllm/harness/PROTOCOL.md) on stdin/stdout with a Qwen3,\n"
    "Qwen3-MoE or Qwen3.5 safetensors checkpoint, or a llama, qwen2 or qwen3 GGUF file.\n"
    "--weight-format auto (default) keeps a Q4_1 GGUF's layer weights in 4 bits (AVX-512 VNNI); float32 does not.\n"
    "--device auto (default): a CUDA device where this build has CUDA and one is there, else the CPU.\n";

// The test modes' input: `serve` for each stdin line (without its newline, the last one even if unterminated)
// until end of input; returns the exit status.
int for_each_stdin_line(const std::function<void(const std::string&)>& serve) {
  std::string pending;
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(0, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t cut;
    while ((cut = pending.find('\n')) != std::string::npos) {
      serve(pending.substr(0, cut));
      pending.erase(0, cut + 1);
    }
  }
  if (!pending.empty()) serve(pending);
  return 0;
}

// The test modes: each stdin line answered with the object `answer` fills for it, or {"error": why} when it throws.
int answer_stdin_lines(const std::function<void(const std::string&, WireValue&)>& answer) {
  return for_each_stdin_line([&](const std::string& line) {
    WireValue out = WireValue::object();
    try {
      answer(line, out);
    } catch (const std::exception& err) {
      out.set("error", WireValue::str(err.what()));
    }
    send(out);
  });
}

// --tokenize DIR|FILE.gguf: no model, only its tokenizer. Each stdin line is a JSON string; each answer line holds its
// "ids" (encoded without the post-processor's special tokens), "decoded" (the ids decoded whole) and "streamed"
// (the ids decoded one token at a time, as generation streams them, joined).
int tokenize(const std::string& dir) {
  TextSide side = open_text_side(dir);
  const BpeTokenizer& tokenizer = *side.tokenizer;
  return answer_stdin_lines([&](const std::string& line, WireValue& out) {
    WireValue in = parse_wire(line);
    if (!in.is_string()) throw std::runtime_error("each line must be a JSON string");
    std::vector<int64_t> ids = tokenizer.encode(in.text, false);
    WireValue list = WireValue::array();
    Utf8Stream stream;
    std::string streamed;
    for (int64_t id : ids) {
      list.items.push_back(WireValue::num(id));
      streamed += stream.push(tokenizer.token_bytes(id));
    }
    streamed += stream.flush();
    out.set("ids", list).set("decoded", WireValue::str(tokenizer.decode(ids, false)))
        .set("streamed", WireValue::str(streamed));
  });
}

// --render-chat DIR|FILE.gguf: each stdin line is a JSON list of {"role", "content"} messages; each answer line holds the
// "text" the chat template renders (with the generation prompt), or the "error" chat is refused with.
int render_chat(const std::string& dir) {
  TextSide side = open_text_side(dir);
  const ChatTemplate& chat = *side.chat;
  return answer_stdin_lines([&](const std::string& line, WireValue& out) {
    WireValue in = parse_wire(line);
    std::vector<ChatMessage> messages;
    for (const WireValue& m : in.items) messages.push_back({m.find("role")->text, m.find("content")->text});
    std::string why = chat.refusal();
    if (why.empty()) out.set("text", WireValue::str(chat.render(messages)));
    else out.set("error", WireValue::str(why));
  });
}

int run(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--tokenize") return tokenize(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "--render-chat") return render_chat(argv[2]);
  std::string model;
  QwenEngineOptions options;
  options.kv_cache_mb = 256.0;
  int64_t max_seqs = 8;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--model") model = value();
    else if (arg == "--ctx") options.max_model_len = std::stoll(value());
    else if (arg == "--max-seqs") max_seqs = std::stoll(value());
    else if (arg == "--kv-cache-mb") options.kv_cache_mb = std::stod(value());
    else if (arg == "--threads") options.num_threads = std::stoll(value());
    else if (arg == "--weight-format") options.weight_format = value();
    else if (arg == "--device") options.device = value();
    else if (arg == "--verbose") g_verbose = true;
    else if (arg == "-h" || arg == "--help") { std::fputs(kUsage, stdout); return 0; }
    else throw std::invalid_argument("unknown argument " + arg);
  }
  if (model.empty()) throw std::invalid_argument("--model DIR or --model FILE.gguf is required");
  if (max_seqs < 1) throw std::invalid_argument("--max-seqs must be >= 1");
  options.max_slots = max_seqs;
  // Protocol lines only on stdout: a private handle on it, and fd 1 pointed at stderr for anything else.
  std::fflush(stdout);
  g_out_fd = ::dup(1);
  ::dup2(2, 1);

  // SIGTERM and SIGINT are taken by one thread (sigwait): the first drains (exit 0, or 130 after SIGINT), a
  // second SIGINT ends the process at once. A closed stdout is an error on write, not a SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  static sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);   // every thread started from here on inherits it
  static int wake[2] = {-1, -1};
  if (::pipe(wake) != 0) throw std::runtime_error("cannot create a pipe");
  g_wake_fd = wake[1];
  static std::atomic<int> received{0};
  static Server* server_ptr = new Server(model, options, max_seqs);   // outlives the signal thread
  Server& server = *server_ptr;
  std::thread([] {
    while (true) {
      int sig = 0;
      if (sigwait(&stop_signals, &sig) != 0) continue;
      if (received.load() == 0) {
        received = sig;
        server_ptr->begin_stop();
        wake_reader();
      } else if (sig == SIGINT) {
        std::_Exit(130);
      }
    }
  }).detach();
  log("DEBUG", "loading " + model);
  std::thread loader([&] { server.load(); });
  std::string pending;
  bool skipping = false;
  char buf[1 << 16];
  auto serve = [&](const std::string& line) {
    bool blank = line.find_first_not_of(" \t\r\n\f\v") == std::string::npos;
    if (!blank) server.handle(line);
  };
  while (!server.stop_reading()) {
    struct pollfd fds[2] = {{0, POLLIN, 0}, {wake[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents) break;
    ssize_t n = ::read(0, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t cut;
    while (!server.stop_reading() && (cut = pending.find('\n')) != std::string::npos) {
      std::string line = pending.substr(0, cut + 1);
      pending.erase(0, cut + 1);
      if (skipping) skipping = false;
      else if (cut > kMaxLineBytes) send_error(kLineTooLong, nullptr);   // it came whole: refused all the same
      else serve(line);
    }
    if (pending.size() > kMaxLineBytes) {   // no newline yet: the rest of the line is skipped as it comes
      if (!skipping) send_error(kLineTooLong, nullptr);
      skipping = true;
      pending.clear();
    }
  }
  if (!pending.empty() && !skipping && !server.stop_reading()) serve(pending);
  loader.join();
  server.drain();
  int status = 0;
  if (server.failed()) {
    send_error("the model failed to load: " + server.load_error(), nullptr);
    status = 1;
  }
  return received.load() == SIGINT ? 130 : status;
}

}  // namespace
}  // namespace pocket

int main(int argc, char** argv) {
  try {
    return pocket::run(argc, argv);
  } catch (const std::exception& err) {
    std::fprintf(stderr, "pocketllm_engine: error: %s\n", err.what());
    return 2;
  }
}
