// The pocketllm_cpp Python module: QwenEngine, QwenBatchCore, QwenBatchScheduler and their value types.
// Calls that run the model release the GIL; callbacks from the scheduler's thread take it, and what they raise
// is reported on stderr and swallowed.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "../src/batch_core.h"
#include "../src/batch_scheduler.h"
#include "../src/q4_weights.h"
#include "../src/qwen_engine.h"

namespace py = pybind11;
using namespace pocket;

namespace {

// A Python callable held by C++ code that may copy or drop it without the GIL.
struct PyCallable {
  std::shared_ptr<py::object> fn;
  explicit PyCallable(py::object f)
      : fn(new py::object(std::move(f)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        }) {}
  template <typename... Args>
  void operator()(const char* what, Args&&... args) const {
    py::gil_scoped_acquire gil;
    try {
      (*fn)(std::forward<Args>(args)...);
    } catch (py::error_already_set& err) {
      std::fprintf(stderr, "pocketllm_cpp: %s callback raised: %s\n", what, err.what());
    }
  }
};

// The scheduler as Python holds it: stopping it (joining its thread) releases the GIL first.
class PyScheduler {
 public:
  PyScheduler(QwenEngine& engine, int64_t max_batch_size)
      : sched_(std::make_unique<QwenBatchScheduler>(engine, max_batch_size)) {}
  ~PyScheduler() {
    py::gil_scoped_release release;
    sched_.reset();
  }
  QwenBatchScheduler& get() { return *sched_; }

 private:
  std::unique_ptr<QwenBatchScheduler> sched_;
};

py::dict stats_dict(const BatchStats& s) {
  py::dict d;
  d["num_requests_running"] = s.running;
  d["num_requests_waiting"] = s.waiting;
  d["kv_cache_free_blocks"] = s.free_blocks;
  d["kv_cache_total_blocks"] = s.total_blocks;
  d["prefix_cache_queries"] = s.prefix_queries;
  d["prefix_cache_hits"] = s.prefix_hits;
  d["num_preemptions"] = s.preemptions;
  d["num_steps"] = s.steps;
  d["spec_verify_chunks"] = s.verify_chunks;
  d["spec_proposed_tokens"] = s.proposed_tokens;
  d["spec_accepted_tokens"] = s.accepted_tokens;
  return d;
}

}  // namespace

// A C-contiguous array's data as a tensor (no copy), and a tensor copied out to a new array.
template <typename T>
at::Tensor as_tensor(const py::array_t<T, py::array::c_style | py::array::forcecast>& a, at::ScalarType type) {
  std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
  return at::from_blob(const_cast<T*>(a.data()), shape, type);
}

template <typename T>
py::array_t<T> to_array(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  py::array_t<T> out(std::vector<py::ssize_t>(c.sizes().begin(), c.sizes().end()));
  std::memcpy(out.mutable_data(), c.data_ptr<T>(), c.numel() * sizeof(T));
  return out;
}

void require_q4_kernel() {
  if (!q4_kernel_supported()) throw std::runtime_error("this CPU lacks AVX-512 VNNI: the 4-bit kernel does not run");
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "PocketLLM's native plane: a C++ Qwen3 and Qwen3.5 engine over libtorch";
#ifdef POCKET_CUDA
  m.attr("backend") = "cuda";
#else
  m.attr("backend") = "cpu";
#endif
  // The 4-bit weights as the engine builds and multiplies them (tests compare them with the Torch plane's).
  m.def("q4_kernel_supported", &q4_kernel_supported);
  m.def("q4_pack", [](const py::array_t<float, py::array::c_style | py::array::forcecast>& weight) {
    require_q4_kernel();
    if (weight.ndim() != 2 || !q4_shape_supported(weight.shape(0), weight.shape(1)))
      throw std::invalid_argument("q4_pack: a [N, K] weight with N a multiple of 16 and K of 32");
    return to_array<uint8_t>(q4_pack(as_tensor(weight, at::kFloat)));
  }, py::arg("weight"));
  m.def("q4_linear", [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x,
                        const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& records) {
    require_q4_kernel();
    if (x.ndim() != 2 || records.ndim() != 3 || records.shape(2) != 320 || x.shape(1) != records.shape(1) * 32)
      throw std::invalid_argument("q4_linear: x [T, K] and records [N / 16, K / 32, 320]");
    std::vector<uint8_t> scratch;
    return to_array<float>(q4_linear(as_tensor(x, at::kFloat), as_tensor(records, at::kByte), at::Tensor(), scratch));
  }, py::arg("x"), py::arg("records"));

  py::class_<SamplingOptions>(m, "QwenBatchSamplingParams")
      .def(py::init<>())
      .def_readwrite("max_new_tokens", &SamplingOptions::max_new_tokens)
      .def_readwrite("temperature", &SamplingOptions::temperature)
      .def_readwrite("top_k", &SamplingOptions::top_k)
      .def_readwrite("top_p", &SamplingOptions::top_p)
      .def_readwrite("seed", &SamplingOptions::seed)
      .def_readwrite("ignore_eos", &SamplingOptions::ignore_eos)
      .def_readwrite("stop_token_ids", &SamplingOptions::stop_token_ids)
      .def_readwrite("logprobs", &SamplingOptions::logprobs)
      .def_readwrite("min_p", &SamplingOptions::min_p)
      .def_readwrite("repetition_penalty", &SamplingOptions::repetition_penalty)
      .def_readwrite("frequency_penalty", &SamplingOptions::frequency_penalty)
      .def_readwrite("presence_penalty", &SamplingOptions::presence_penalty)
      .def_readwrite("logit_bias", &SamplingOptions::logit_bias);

  py::class_<QwenEngineOptions>(m, "QwenEngineOptions")
      .def(py::init<>())
      .def_readwrite("block_size", &QwenEngineOptions::block_size)
      .def_readwrite("num_kv_blocks", &QwenEngineOptions::num_kv_blocks)
      .def_readwrite("kv_cache_mb", &QwenEngineOptions::kv_cache_mb)
      .def_readwrite("max_model_len", &QwenEngineOptions::max_model_len)
      .def_readwrite("max_slots", &QwenEngineOptions::max_slots)
      .def_readwrite("prefix_caching", &QwenEngineOptions::prefix_caching)
      .def_readwrite("state_snapshots", &QwenEngineOptions::state_snapshots)
      .def_readwrite("num_threads", &QwenEngineOptions::num_threads)
      .def_readwrite("eos_token_ids", &QwenEngineOptions::eos_token_ids)
      .def_readwrite("sampling", &QwenEngineOptions::sampling)
      .def_readwrite("weight_format", &QwenEngineOptions::weight_format)
      .def_readwrite("device", &QwenEngineOptions::device)
      .def_readwrite("aten_ops", &QwenEngineOptions::aten_ops);

  py::class_<QwenEngine>(m, "QwenEngine")
      .def(py::init<const std::string&, const QwenEngineOptions&>(), py::arg("checkpoint"),
           py::arg("options") = QwenEngineOptions(), py::call_guard<py::gil_scoped_release>())
      .def("prefill", &QwenEngine::prefill, py::arg("prompt_tokens"), py::call_guard<py::gil_scoped_release>())
      .def("decode_step", &QwenEngine::decode_step, py::call_guard<py::gil_scoped_release>())
      .def("decode", &QwenEngine::decode, py::arg("max_new_tokens"), py::call_guard<py::gil_scoped_release>())
      .def("verify", &QwenEngine::verify, py::arg("draft_tokens"), py::call_guard<py::gil_scoped_release>())
      .def("warmup", &QwenEngine::warmup, py::call_guard<py::gil_scoped_release>())
      .def("generate", &QwenEngine::generate, py::arg("prompt_tokens"), py::arg("max_new_tokens"),
           py::call_guard<py::gil_scoped_release>())
      .def("reset", &QwenEngine::reset, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("eos_id", &QwenEngine::eos_id)
      .def_property_readonly("eos_token_ids", &QwenEngine::eos_token_ids)
      .def_property_readonly("eos_source", &QwenEngine::eos_source)
      .def_property_readonly("max_model_len", &QwenEngine::max_model_len)
      .def_property_readonly("vocab_size", [](const QwenEngine& e) { return e.config().vocab_size; })
      .def_property_readonly("architecture", [](const QwenEngine& e) { return e.config().architecture; })
      .def_property_readonly("num_parameters", &QwenEngine::num_parameters)
      .def_property_readonly("decode_weight_bytes", &QwenEngine::decode_weight_bytes)
      .def_property_readonly("weight_format", &QwenEngine::weight_format)
      .def_property_readonly("num_kv_blocks", [](QwenEngine& e) { return e.pool().num_blocks(); })
      .def_property_readonly("block_size", [](QwenEngine& e) { return e.pool().block_size(); })
      .def_property_readonly("session_length", &QwenEngine::session_length)
      .def_property_readonly("session_cached_tokens", &QwenEngine::session_cached_tokens)
      .def_property_readonly("num_state_snapshots", &QwenEngine::num_state_snapshots)
      .def_property_readonly("options", &QwenEngine::options)
      .def_property_readonly("device", &QwenEngine::device);

  py::class_<BatchEvent>(m, "QwenBatchEvent")
      .def_readonly("request_id", &BatchEvent::request_id)
      .def_readonly("token", &BatchEvent::token)
      .def_readonly("eos", &BatchEvent::eos)
      .def_readonly("finish_reason", &BatchEvent::finish_reason)
      .def_readonly("prompt_tokens", &BatchEvent::prompt_tokens)
      .def_readonly("completion_tokens", &BatchEvent::completion_tokens)
      .def_readonly("cached_tokens", &BatchEvent::cached_tokens)
      .def_property_readonly("logprob",
                             [](const BatchEvent& e) -> py::object {
                               return e.has_logprobs ? py::object(py::float_(e.logprobs.logprob)) : py::none();
                             })
      .def_property_readonly("top_ids", [](const BatchEvent& e) { return e.logprobs.top_ids; })
      .def_property_readonly("top_logprobs", [](const BatchEvent& e) { return e.logprobs.top_logprobs; });

  py::class_<BatchResult>(m, "QwenBatchResult")
      .def_readonly("request_id", &BatchResult::request_id)
      .def_readonly("tokens", &BatchResult::tokens)
      .def_readonly("finish_reason", &BatchResult::finish_reason)
      .def_readonly("error", &BatchResult::error)
      .def_readonly("prompt_tokens", &BatchResult::prompt_tokens)
      .def_readonly("completion_tokens", &BatchResult::completion_tokens)
      .def_readonly("cached_tokens", &BatchResult::cached_tokens);

  py::class_<EngineCaps>(m, "QwenEngineCaps")
      .def_readonly("max_slots", &EngineCaps::max_slots)
      .def_readonly("continuous_batching", &EngineCaps::continuous_batching)
      .def_readonly("chunked_prefill", &EngineCaps::chunked_prefill)
      .def_readonly("paged_kv", &EngineCaps::paged_kv)
      .def_readonly("prefix_caching", &EngineCaps::prefix_caching)
      .def_readonly("per_request_sampling", &EngineCaps::per_request_sampling)
      .def_readonly("per_request_top_k", &EngineCaps::per_request_top_k)
      .def_readonly("speculative", &EngineCaps::speculative);

  // Stepped by its caller (the Python backend's engine thread): no thread of its own.
  py::class_<BatchCore>(m, "QwenBatchCore")
      .def(py::init<QwenEngine&, int64_t>(), py::arg("engine"), py::arg("max_batch_size"), py::keep_alive<1, 2>())
      .def("add", &BatchCore::add, py::arg("request_id"), py::arg("prompt_tokens"), py::arg("sampling"))
      .def("cancel", &BatchCore::cancel, py::arg("request_id"), py::call_guard<py::gil_scoped_release>())
      .def("step", &BatchCore::step, py::call_guard<py::gil_scoped_release>())
      .def("has_work", &BatchCore::has_work)
      .def("active", &BatchCore::active, py::arg("request_id"))
      .def("set_prefill_token_budget", &BatchCore::set_prefill_token_budget, py::arg("tokens"))
      .def("set_ngram_speculation",
           [](BatchCore& c, int64_t num_tokens, int64_t min_n, int64_t max_n) {
             c.set_ngram_speculation(NgramOptions{num_tokens, min_n, max_n});
           },
           py::arg("num_speculative_tokens"), py::arg("prompt_lookup_min") = 1, py::arg("prompt_lookup_max") = 4)
      .def("max_batch_size", &BatchCore::max_slots)
      .def("stats", [](BatchCore& c) { return stats_dict(c.stats()); });

  py::class_<PyScheduler>(m, "QwenBatchScheduler")
      .def(py::init<QwenEngine&, int64_t>(), py::arg("engine"), py::arg("max_batch_size") = 4,
           py::keep_alive<1, 2>())
      .def(
          "submit_request",
          [](PyScheduler& s, const std::vector<int64_t>& prompt, const SamplingOptions& sampling, py::object callback,
             py::object on_token) {
            ResultCallback done;
            TokenCallback token;
            if (!callback.is_none()) {
              PyCallable cb(callback);
              done = [cb](const BatchResult& r) { cb("completion", r); };
            }
            if (!on_token.is_none()) {
              PyCallable cb(on_token);
              token = [cb](const std::string& id, int64_t t) { cb("on_token", id, t); };
            }
            py::gil_scoped_release release;
            return s.get().submit(prompt, sampling, std::move(done), std::move(token));
          },
          py::arg("prompt_tokens"), py::arg("sampling"), py::arg("callback") = py::none(),
          py::arg("on_token") = py::none())
      .def(
          "poll_result",
          [](PyScheduler& s, const std::string& id, int64_t timeout_ms) {
            py::gil_scoped_release release;
            return s.get().poll(id, timeout_ms);
          },
          py::arg("request_id"), py::arg("timeout_ms") = -1)
      .def("cancel", [](PyScheduler& s, const std::string& id) { return s.get().cancel(id); }, py::arg("request_id"))
      .def("engine_caps", [](PyScheduler& s) { return s.get().caps(); })
      .def("max_batch_size", [](PyScheduler& s) { return s.get().max_batch_size(); })
      .def("set_prefill_token_budget",
           [](PyScheduler& s, int64_t tokens) { s.get().set_prefill_token_budget(tokens); }, py::arg("tokens"))
      .def("set_ngram_speculation",
           [](PyScheduler& s, int64_t num_tokens, int64_t min_n, int64_t max_n) {
             s.get().set_ngram_speculation(NgramOptions{num_tokens, min_n, max_n});
           },
           py::arg("num_speculative_tokens"), py::arg("prompt_lookup_min") = 1, py::arg("prompt_lookup_max") = 4)
      .def("stats", [](PyScheduler& s) {
        BatchStats st;
        {
          py::gil_scoped_release release;
          st = s.get().stats();
        }
        return stats_dict(st);
      })
      .def("stop", [](PyScheduler& s) {
        py::gil_scoped_release release;
        s.get().stop();
      });
}
