"""The OpenAI-compatible server, exercised as a subprocess with real clients and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess

pytestmark = pytest.mark.usefixtures("smollm2_gguf")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["--no-engine-process", "--engine-process"])
def server(request):
    """The server with the engine on a thread of its process, and in a process of its own."""
    proc = ServerProcess("--served-model-name", "smollm2", request.param)
    try:
        proc.wait_alive()
        seen_loading = httpx.get(proc.url + "/ready").status_code == 503
        proc.wait_ready()
        proc.seen_loading = seen_loading
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_ready_is_503_while_loading_then_200(server):
    assert server.seen_loading, "/ready should answer 503 while the model loads"
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/alive").status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "smollm2"


def test_openai_chat_sync(client):
    response = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=32)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0
    assert response.model == "smollm2"


def test_openai_chat_async(server):
    from openai import AsyncOpenAI

    async def main() -> list[str]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        responses = await asyncio.gather(*(client.chat.completions.create(
            model="x", messages=FRANCE, temperature=0, max_tokens=32) for _ in range(4)))
        await client.close()
        return [r.choices[0].message.content for r in responses]

    texts = asyncio.run(main())
    assert len(set(texts)) == 1 and "Paris" in texts[0]


def test_streaming_equals_non_streaming(client):
    whole = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=40, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason


def test_stream_include_usage_ends_with_the_usage(client, server):
    """stream_options.include_usage: the openai client's usage chunk (no choices) equals the full response's."""
    whole = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=12, n=2)
    chunks = list(client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=12, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                     max_tokens=12, stream_usage=True)
    total = None
    for part in llm.stream("What is the capital of France?"):
        total = part if total is None else total + part
    assert total.usage_metadata is not None and total.usage_metadata["output_tokens"] > 0


def test_n_choices_greedy_and_usage(client):
    one = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=16)
    three = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=16, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_choices_sampled_with_seed_differ_and_reproduce(client):
    kwargs = dict(model="x", messages=FRANCE, temperature=1.0, max_tokens=24, n=3, seed=7)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1


# The rule docs/server.md states for ``n`` with a ``seed``: choice i is seeded with (s + i × 1,000,003) mod 2^63.
SEED_STRIDE = 1_000_003


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoint):
    """A server of the tiny float32 checkpoint: a row's logits do not depend on the batch it runs in."""
    proc = ServerProcess("--model", tiny_checkpoint("llama"), "--cpu-kv-cache-gb", "0.05")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _sampled_choices(server: ServerProcess, seed: int, n: int) -> list[str]:
    body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True,
            "seed": seed, "n": n}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.parametrize("seed", [7, 2**63 - 2])
def test_n_choices_follow_the_documented_seed_rule(tiny_server, seed):
    """Choice i of n with seed s reproduces, differs from the others, and is the single request with seed
    (s + i × 1,000,003) mod 2^63."""
    choices = _sampled_choices(tiny_server, seed, 3)
    assert _sampled_choices(tiny_server, seed, 3) == choices
    assert len(set(choices)) == 3
    alone = [_sampled_choices(tiny_server, (seed + i * SEED_STRIDE) % 2**63, 1)[0] for i in range(3)]
    assert alone == choices


def test_n_choices_stream_interleaved(client):
    stream = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=16, n=2,
                                            stream=True)
    order = [c.index for chunk in stream for c in chunk.choices]
    assert set(order) == {0, 1}
    first_end = max(i for i, idx in enumerate(order) if idx == order[0])
    assert any(idx != order[0] for idx in order[:first_end]), "choices should advance together"


def test_chat_logprobs(client):
    response = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=8,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8")
    assert joined == response.choices[0].message.content


def test_completions_with_logprobs(client):
    response = client.completions.create(model="x", prompt="The capital of France is", temperature=0,
                                         max_tokens=6, logprobs=2)
    choice = response.choices[0]
    assert choice.text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) >= 1
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs)


def test_stop_strings_straddling_tokens(client):
    whole = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=32)
    text = whole.choices[0].message.content
    assert "Paris" in text
    stop = "of Fr"   # begins inside one token and ends inside the next
    cut = text[: text.index(stop)]
    plain = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=32, stop=[stop])
    assert plain.choices[0].message.content == cut
    assert plain.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=32,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_langchain_invoke_and_stream(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                     max_tokens=32)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    streamed = "".join(chunk.content for chunk in llm.stream("What is the capital of France?"))
    assert streamed == answer.content


@pytest.mark.parametrize("stop", [None, ["Paris"]])
def test_streamed_chat_logprobs_equal_the_whole_response(client, stop):
    kwargs = dict(model="x", messages=FRANCE, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
                  stop=stop)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [entry for c in chunks if c.logprobs is not None for entry in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    text = "".join(c.delta.content or "" for c in chunks)
    assert text == whole.message.content
    assert b"".join(bytes(e.bytes) for e in streamed).decode("utf-8").startswith(text)


def test_streamed_completion_logprobs_equal_the_whole_response(client):
    kwargs = dict(model="x", prompt="The capital of France is", temperature=0, max_tokens=8, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    tokens, offsets, tops = [], [], []
    for chunk in chunks:
        if chunk.logprobs is not None:
            tokens += chunk.logprobs.tokens
            offsets += chunk.logprobs.text_offset
            tops += chunk.logprobs.top_logprobs
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert tops == whole.top_logprobs


CHAT = {"model": "x", "messages": FRANCE, "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": "x", "prompt": "Hello", "max_tokens": 4, "temperature": 0}

REFUSALS = [
    ("chat", {"stop": 5}, "stop"),
    ("completions", {"stop": {"a": 1}}, "stop"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"echo": True}, "echo"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ("chat", {"n": 129}, "n"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": 1.5}, "n"),
    ("chat", {"no_such_field": 1}, "no_such_field"),
    ("completions", {"no_such_field": 1}, "no_such_field"),
]


def _post(server, endpoint: str, extra: dict) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **extra}
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize(("endpoint", "extra", "param"), REFUSALS)
def test_refusals_are_400_naming_the_field(server, endpoint, extra, param):
    response = _post(server, endpoint, extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


ACCEPTED = [
    ("chat", {"user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "model": "other",
              "parallel_tool_calls": True}),
    ("chat", {"logprobs": False, "frequency_penalty": 0, "presence_penalty": 0, "stop": [], "logit_bias": {},
              "n": 1, "tool_choice": "auto", "stream_options": {"include_usage": True}, "top_logprobs": 0}),
    ("chat", {"stop": ["", "\n\n\n\n"], "max_completion_tokens": 3, "max_tokens": 9}),
    ("completions", {"echo": False, "best_of": 1, "suffix": None, "logprobs": None, "frequency_penalty": 0,
                     "presence_penalty": 0, "logit_bias": {}, "stop": [], "user": "u", "n": 1, "top_logprobs": None}),
    ("completions", {"suffix": ""}),
    ("chat", {"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"42": -100}}),
]


@pytest.mark.parametrize(("endpoint", "extra"), ACCEPTED)
def test_inert_fields_and_explicit_defaults_are_accepted(server, endpoint, extra):
    response = _post(server, endpoint, extra)
    assert response.status_code == 200, response.text


def test_max_completion_tokens_wins(server):
    body = _post(server, "chat", {"max_completion_tokens": 2, "max_tokens": 9, "temperature": 0}).json()
    assert body["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/embeddings"), ("POST", "/v1/embeddings"),
                                              ("GET", "/nope"), ("PUT", "/v1/models"), ("GET", "/v1/chat/completions")])
def test_unregistered_paths_are_404(server, method, path):
    response = httpx.request(method, server.url + path, json={})
    assert response.status_code == 404
    assert "error" in response.json()


def test_an_oversized_body_is_refused_from_its_content_length(server):
    """A 20 MB body is a 413 from its headers alone (none of it is sent); the server answers on."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 20000000\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def _read_until_closed(sock, reply: bytes = b"") -> bytes:
    while not reply.rstrip().endswith(b"}"):
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        reply += data
    return reply


def test_health_answers_while_a_20_mb_body_arrives_then_it_is_a_413(server):
    """A 20 MB chunked body (no Content-Length): /health answers while the first 4 MB are in and unanswered,
    and the body is a 413 in the OpenAI shape once past the limit (8 MiB)."""
    import socket

    chunk = b" " * (1 << 20)
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):
            sock.sendall(frame)
        health = httpx.get(server.url + "/health", timeout=60)
        sock.setblocking(False)
        try:
            early = sock.recv(65536)   # nothing answered yet: the body is within the limit so far
        except BlockingIOError:
            early = b""
        sock.setblocking(True)
        assert health.status_code == 200 and health.json()["status"] == "ok" and early == b""
        try:
            for _ in range(16):
                sock.sendall(frame)
            sock.sendall(b"0\r\n\r\n")
        except OSError:   # the server stopped reading once it had answered
            pass
        reply = _read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "larger than 8388608 bytes" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_foreign_host_header_is_refused(server):
    """Bound to loopback without an API key: a DNS-rebound name is refused, loopback names are served."""
    refused = httpx.get(server.url + "/v1/models", headers={"Host": f"attacker.example:{server.port}"})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert httpx.get(server.url + "/v1/models", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    cross = httpx.get(server.url + "/v1/models", headers={"Origin": "http://attacker.example"})
    assert cross.status_code == 403


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^pocketllm:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"metric {name} missing"
    return float(match.group(1))


def test_metrics_exposed(server, client):
    client.chat.completions.create(model="x", messages=FRANCE, temperature=0, max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "prompt_tokens_total", "generation_tokens_total", "num_preemptions",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_success_total", "request_aborted_total"):
        assert f"pocketllm:{name}" in text, name
    assert _metric(server, "generation_tokens_total") > 0


def test_n_choices_share_one_prefill_of_the_prompt(server):
    """``n`` choices of one prompt are separate engine requests; the first prefills the prompt and the others
    wait for its blocks and take them from the prefix cache (prefilled together, they would all miss)."""
    _wait_idle(server)
    words = [f"w{i}x{time.monotonic_ns() % 9973}" for i in range(120)]   # a prompt no earlier test sent
    prompt = " ".join(words)
    hits, queries = _metric(server, "prefix_cache_hits_total"), _metric(server, "prefix_cache_queries_total")
    n = 4
    body = _post(server, "completions", {"prompt": prompt, "n": n, "max_tokens": 2, "temperature": 0}).json()
    prompt_tokens = body["usage"]["prompt_tokens"]   # counted once, not once a choice
    assert prompt_tokens > 100 and len(body["choices"]) == n
    hit = _metric(server, "prefix_cache_hits_total") - hits
    assert _metric(server, "prefix_cache_queries_total") - queries >= n * (prompt_tokens - 16)
    block = 16   # every choice after the first finds the prompt's whole blocks but its last token's
    assert hit == (n - 1) * ((prompt_tokens - 1) // block * block), (hit, prompt_tokens)


def _finished(server, reason: str) -> float:
    """``pocketllm:request_success_total`` for one finish reason (0 before the first such request)."""
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf'^pocketllm:request_success_total{{finished_reason="{reason}"}} ([0-9.e+-]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _aborted(server, reason: str) -> float:
    """``pocketllm:request_aborted_total`` for one reason."""
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf'^pocketllm:request_aborted_total{{reason="{reason}"}} ([0-9.e+-]+)$', text, re.M)
    assert match, f"no aborted counter for {reason}"
    return float(match.group(1))


def _wait_aborted(server, reason: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _aborted(server, reason) != value:
        assert time.monotonic() < deadline, f"request_aborted_total{{reason={reason!r}}} never reached {value}"
        time.sleep(0.02)


def _wait_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _metric(server, "num_requests_running") == 0 and _metric(server, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("blocks were not freed")


def test_disconnect_frees_blocks(server):
    _wait_idle(server)
    aborted = _aborted(server, "client_disconnect")
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0.8}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert _metric(server, "num_requests_running") == 1
        assert _metric(server, "kv_cache_usage_perc") > 0
    _wait_idle(server)
    _wait_aborted(server, "client_disconnect", aborted + 1)


def test_non_streaming_disconnect_frees_blocks(server):
    _wait_idle(server)
    aborted = _aborted(server, "client_disconnect")
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "temperature": 0.8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    _wait_idle(server)
    _wait_aborted(server, "client_disconnect", aborted + 1)


def test_delete_cancels_active_request_and_404s_otherwise(server):
    _wait_idle(server)
    aborted = _aborted(server, "cancel")
    assert httpx.delete(server.url + "/v1/requests/never-seen").status_code == 404
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0.8,
            "request_id": "cancel-me"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        _wait_for(server, "num_requests_running", 1)
        assert _metric(server, "kv_cache_usage_perc") > 0
        deleted = httpx.delete(server.url + "/v1/requests/cancel-me")
        assert deleted.status_code == 200
        assert deleted.json() == {"id": "cancel-me", "object": "request.cancelled", "cancelled": True}
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert [r for r in reasons if r is not None] == ["cancelled"]
    _wait_idle(server)  # its KV blocks are freed
    assert httpx.delete(server.url + "/v1/requests/cancel-me").status_code == 404
    assert _aborted(server, "cancel") == aborted + 1   # counted before its last chunk was sent


def _wait_for(server, name: str, value: float, timeout: float = 60) -> None:
    """Wait until the gauge ``name`` reads ``value`` on /metrics."""
    deadline = time.monotonic() + timeout
    while _metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_api_key_and_deadline():
    proc = ServerProcess("--api-key", "sekret", "--request-timeout", "1", "--max-num-seqs", "1")
    try:
        proc.wait_ready()
        assert httpx.get(proc.url + "/v1/models").status_code == 401
        assert httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        headers = {"Authorization": "Bearer sekret"}
        assert httpx.get(proc.url + "/v1/models", headers=headers).status_code == 200
        url = proc.url + "/v1/chat/completions"
        # 8000 tokens cannot be decoded in 1 s on a CPU: no choice finishes, the request is a 504 timeout.
        late = httpx.post(url, headers=headers, timeout=60,
                          json={**CHAT, "max_tokens": 8000, "n": 3, "temperature": 0.8, "ignore_eos": True})
        assert late.status_code == 504, late.text
        error = late.json()["error"]
        assert error["type"] == "timeout" and "did not finish within 1.0 s" in error["message"]
        _wait_idle(proc)  # the choices that missed the deadline were cancelled, their blocks freed
        assert _finished(proc, "length") == _finished(proc, "stop") == 0
        assert _aborted(proc, "deadline") == 1 and _aborted(proc, "client_disconnect") == 0
    finally:
        proc.stop()


@pytest.mark.parametrize("engine", ["--no-engine-process", "--engine-process"])
def test_sigterm_drains_then_cancels_the_running_request(engine):
    proc = ServerProcess("--shutdown-timeout", "1", "--max-num-seqs", "1", engine)
    try:
        proc.wait_ready()
        results: dict = {}

        def long_request() -> None:
            body = {**CHAT, "max_tokens": 8000, "temperature": 0.8, "ignore_eos": True}
            results["response"] = httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=120)

        worker = threading.Thread(target=long_request)
        worker.start()
        _wait_for(proc, "num_requests_running", 1)  # the request is in the engine before the signal
        proc.proc.send_signal(signal.SIGTERM)
        worker.join(120)
        assert proc.proc.wait(30) == 0
        response = results["response"]
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "cancelled"
        assert 0 < response.json()["usage"]["completion_tokens"] < 8000
    finally:
        proc.stop()
