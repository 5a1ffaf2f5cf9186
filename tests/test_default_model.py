"""The real default model (SmolLM2-135M-Instruct GGUF): parity with transformers, chat, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    with LLM(EngineArgs(model=smollm2_gguf)) as engine:
        yield engine


def test_default_model_is_the_packaged_gguf(smollm2_gguf):
    from pocketllm.loaders.default_model import default_model_path

    assert default_model_path() == smollm2_gguf


def test_greedy_matches_transformers_on_the_gguf(llm, smollm2_gguf, hf_reference):
    tok = llm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "List three colours:"]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(tok.encode(llm.render_chat(FRANCE), add_special_tokens=False))
    expected = hf_reference.greedy(smollm2_gguf, prompts, 32)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


def test_chat_answers_paris(llm):
    out = llm.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "pocketllm", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


def test_cli_run_answers_paris():
    result = _cli("run", "--prompt", "What is the capital of France?", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens" in result.stderr and "prefill" in result.stderr and "decode" in result.stderr


def test_cli_chat_holds_a_conversation():
    result = _cli("chat", "--temperature", "0", "--max-tokens", "40",
                  stdin="What is the capital of France?\nAnd of Italy?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Rome" in result.stdout


def test_cli_reports_errors_cleanly():
    result = _cli("run", "--prompt", "hi", "--backend", "cpp")
    assert result.returncode == 2
    assert "native" in result.stderr and "Traceback" not in result.stderr
