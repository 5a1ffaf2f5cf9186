"""``pocketllm pipe``: the JSONL protocol over stdio, exercised as a subprocess with the default model."""

from __future__ import annotations

import pytest
from harness_utils import (
    FRANCE,
    PipeProcess,
    check_chat_usage_and_diag,
    check_four_conversations_interleave,
    check_fuzz_lines_answered,
    check_running_id_refused,
    check_sampling_fields,
    check_sessions,
    checkpoint_without_template,
)

from pocketllm.harness.protocol import LINE_TOO_LONG, MAX_LINE_BYTES

pytestmark = pytest.mark.usefixtures("smollm2_gguf")


# tests/test_engine_exe.py runs these tests against the native executable: it overrides these two fixtures.
@pytest.fixture(scope="module")
def pipe_process():
    """Starts the pipe under test with the given arguments: ``pocketllm pipe`` with the default model."""
    return PipeProcess


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory, tiny_checkpoint):
    """A checkpoint whose tokenizer has no chat template."""
    return checkpoint_without_template(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("no-template")))


@pytest.fixture(scope="module")
def pipe(pipe_process):
    proc = pipe_process("--ctx", "2048", "--max-seqs", "6")
    # The first line is answered at once, while the model is still loading.
    proc.send({"op": "health", "id": "first"})
    proc.first_health = proc.router.first("first", timeout=60)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        assert not proc.impure, f"stdout carried non-protocol lines: {proc.impure[:3]}"


def test_health_says_loading_then_ready(pipe):
    assert pipe.first_health["state"] == "loading"
    assert pipe.first_health["model"].endswith(".gguf")
    pipe.send({"op": "health", "id": 1})
    health = pipe.router.first(1)
    assert health == {"id": 1, "state": "ready", "model": pipe.first_health["model"]}


def test_chat_streams_then_done_with_eos_usage_and_diag(pipe):
    text, done = check_chat_usage_and_diag(pipe, "gguf")
    assert text == "The capital of France is Paris."
    assert done["finish"] == "eos"


def test_budget_finish_and_end_of_generation_tokens_never_in_chunks(pipe):
    pipe.send({"op": "generate", "id": 3, "prompt": "The quick brown fox", "n": 5, "temp": 0})
    lines = []
    while not lines or not (lines[-1].get("done") or "error" in lines[-1]):
        lines.append(pipe.router.first(3))
    assert lines[-1]["finish"] == "budget" and lines[-1]["usage"]["gen_tokens"] == 5
    chunks = [line["chunk"] for line in lines[:-1]]
    assert chunks and all(isinstance(c, str) and c for c in chunks)
    # Chat answers end on <|im_end|>, which no chunk may carry.
    for i in range(3):
        pipe.send({"op": "chat", "id": f"eog{i}", "messages": FRANCE, "temp": 0.7, "seed": i, "n": 40})
    for i in range(3):
        text, done = pipe.router.collect(f"eog{i}")
        assert "<|im_end|>" not in text and "<|im_start|>" not in text
        assert done["finish"] in ("eos", "budget")


def test_stop_string_finish(pipe):
    text, done = pipe.request({"op": "chat", "id": 4, "messages": FRANCE, "temp": 0, "stop": ["Paris"]})
    assert done["finish"] == "stop"
    assert text == "The capital of France is "


def test_sampling_fields_are_acted_on(pipe):
    check_sampling_fields(pipe, echo_tokens=4)


def test_cancel(pipe):
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    pipe.send({"op": "chat", "id": 5, "messages": story, "n": 1500, "temp": 0.8, "seed": 1})
    first = pipe.router.first(5)
    assert "chunk" in first
    pipe.send({"op": "cancel", "id": 5})
    text, done = pipe.router.collect(5)
    assert done["finish"] == "cancel"
    assert done["usage"]["gen_tokens"] < 1500
    _, error = pipe.request({"op": "cancel", "id": 5})
    assert "no running request" in error["error"]


def test_four_conversations_multiplexed(pipe):
    results = check_four_conversations_interleave(pipe)
    assert results[0][0].startswith("The capital of France is Paris")


def test_sessions_on_the_pipe(pipe):
    assert "Paris" in check_sessions(pipe, "pipe")


@pytest.mark.parametrize("line, id_, needle", [
    ("not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ('{"op": "generate", "id": 1.5, "prompt": "x"}', None, "id must be"),
    ('{"op": "teleport", "id": 9}', 9, "unknown op"),
    ('{"op": "generate", "id": 10, "prompt": "x", "max_tokens": 5, "frequency_penalty": 1}', 10,
     "'frequency_penalty', 'max_tokens'"),
    ('{"op": "health", "id": 11, "verbose": true}', 11, "'verbose'"),
    ('{"op": "generate", "prompt": "x"}', None, "needs an 'id'"),
    ('{"op": "generate", "id": 12}', 12, "prompt"),
    ('{"op": "generate", "id": 13, "prompt": "x", "n": 0}', 13, "n must be"),
    ('{"op": "generate", "id": 14, "prompt": "x", "temp": -1}', 14, "temp"),
    ('{"op": "generate", "id": 15, "prompt": "x", "top_p": 1.5}', 15, "top_p"),
    ('{"op": "generate", "id": 16, "prompt": "x", "stop": [1]}', 16, "stop"),
    ('{"op": "generate", "id": 17, "prompt": "x", "temp": NaN}', None, "not valid JSON"),
    ('{"op": "chat", "id": 18, "messages": [{"role": "robot", "content": "x"}]}', 18, "role"),
    ('{"op": "chat", "id": 19, "messages": [{"role": "user", "content": "x", "name": "a"}]}', 19, "'name'"),
    ('{"op": "auth", "id": 20, "token": "t"}', 20, "pipe needs no token"),
    ('{"op": "close", "id": 21, "session": "nope"}', 21, "unknown session"),
    ('{"op": "open", "id": 22, "session": "../etc"}', 22, "session must be"),
    ('{"op": "generate", "id": 23, "prompt": "x", "diag": "yes"}', 23, "diag"),
])
def test_bad_lines_are_answered_with_an_error(pipe, line, id_, needle):
    pipe.send(line)
    reply = pipe.router.untagged_matching(lambda x: "error" in x) if id_ is None else pipe.router.first(id_)
    assert set(reply) == {"id", "error"}
    assert reply["id"] == id_ and needle in reply["error"], reply


def test_a_prompt_certainly_past_the_context_is_refused_before_it_is_encoded(pipe):
    """200,000 bytes are more than 81 (SmolLM2's longest token) x 2,048 (--ctx): refused from the byte count."""
    _, error = pipe.request({"op": "generate", "id": "huge", "prompt": "x" * 200_000})
    assert "the prompt is at least 2470 tokens and the context is 2048" in error["error"], error
    pipe.send({"op": "health", "id": "after-huge"})
    assert pipe.router.first("after-huge")["state"] == "ready"


def test_duplicate_running_id_is_refused(pipe):
    """A line reusing the id of a running request is refused with an untagged error naming the id; the request
    runs on, and its id is free again once it has ended."""
    check_running_id_refused(pipe, 1500, seed=1)


def test_a_line_over_the_limit_is_answered_and_the_pipe_carries_on(pipe):
    """A line over 8 MiB is answered with an untagged error and not read, whether it came whole or grew past the
    limit before its newline; a line of exactly 8 MiB is served; a request running meanwhile finishes."""
    pipe.send({"op": "generate", "id": "beside-long", "prompt": "Once upon a time", "n": 24, "temp": 0})

    def health(request_id: str, size: int) -> bytes:
        line = b'{"op":"health","id":"' + request_id.encode() + b'"'
        return line + b" " * (size - len(line) - 1) + b"}"
    pipe.send(health("at-limit", MAX_LINE_BYTES))
    pipe.send(health("over-limit", MAX_LINE_BYTES + 1))
    pipe.send(b"x" * (MAX_LINE_BYTES + (3 << 20)))
    pipe.send({"op": "health", "id": "after-long"})
    assert pipe.router.first("at-limit", timeout=60)["state"] == "ready"
    for _ in range(2):
        assert pipe.router.untagged_matching(lambda x: x.get("error") == LINE_TOO_LONG, timeout=60)
    assert pipe.router.first("after-long", timeout=60)["state"] == "ready"
    assert "over-limit" not in pipe.router.by_id
    _, done = pipe.router.collect("beside-long")
    assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 24


def test_fuzz_lines_then_health(pipe):
    check_fuzz_lines_answered(pipe)
    text, done = pipe.request({"op": "chat", "id": "post-fuzz", "messages": FRANCE, "temp": 0})
    assert text == "The capital of France is Paris."


def test_every_id_is_answered_after_a_line_whose_id_holds_a_lone_surrogate(pipe_process):
    """A lone surrogate in an id is echoed back escaped; the lines after it, a generation and the shutdown
    included, are all answered, and the process exits 0."""
    surrogate = "\ud800"   # sent as the JSON escape \ud800 (json.dumps escapes it)
    proc = pipe_process("--ctx", "256")
    try:
        proc.wait_ready()
        proc.send({"op": "health", "id": surrogate})
        proc.send({"op": "generate", "id": "bad" + surrogate, "prompt": "x" + surrogate})
        proc.send({"op": "generate", "id": 2, "prompt": "Once upon a time", "n": 3, "temp": 0})
        proc.send({"op": "shutdown", "id": 3})
        assert proc.router.first(surrogate)["state"] == "ready"
        assert "not valid Unicode" in proc.router.first("bad" + surrogate)["error"]
        assert proc.router.first(3)["state"] == "draining"
        assert proc.proc.wait(60) == 0, proc.error_output()
        proc.reader.join(10)
        _, done = proc.router.collect(2, timeout=1)
        assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 3
        assert not proc.impure
    finally:
        proc.stop()


def test_eof_drains_and_exits_zero(pipe_process):
    """Closing stdin lets running requests finish, then the process exits 0 (its own process)."""
    proc = pipe_process("--ctx", "256")
    try:
        proc.wait_ready()
        proc.send({"op": "generate", "id": "last", "prompt": "Once upon a time", "n": 12, "temp": 0})
        proc.proc.stdin.close()
        assert proc.proc.wait(60) == 0, proc.error_output()
        proc.reader.join(10)
        _, done = proc.router.collect("last", timeout=1)
        assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 12
        assert not proc.impure
    finally:
        proc.stop()


def test_chat_refused_without_template_and_shutdown_drains(pipe_process, no_template_model):
    proc = pipe_process("--model", no_template_model, "--ctx", "256", "--verbose")   # DEBUG logs, all on stderr
    try:
        proc.wait_ready()
        _, error = proc.request({"op": "chat", "id": 1, "messages": FRANCE})
        assert "no chat template" in error["error"]
        text, done = proc.request({"op": "generate", "id": 2, "prompt": "hello", "n": 3, "temp": 0})
        assert done["finish"] in ("budget", "eos")
        proc.send({"op": "generate", "id": 3, "prompt": "hello", "n": 40, "temp": 0})
        proc.send({"op": "shutdown", "id": "bye"})
        proc.send({"op": "generate", "id": 4, "prompt": "ignored", "n": 2})
        assert proc.router.first("bye")["state"] == "draining"
        assert proc.proc.wait(60) == 0, proc.error_output()
        proc.reader.join(10)
        _, done = proc.router.collect(3, timeout=1)
        assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 40
        assert 4 not in proc.router.by_id
        assert not proc.impure and "DEBUG" in proc.error_output()
    finally:
        proc.stop()

