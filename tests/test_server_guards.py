"""The server's edge over a stub engine, in process and behind uvicorn as ``pocketllm serve`` configures it: body
size limit, Host/Origin checks, the served name, the routes' edges (HEAD, trailing slashes, one model), the
catch-all error shape, prompts encoded off the event loop, and requests that are cut short or never end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError
from pocketllm.request_builder import EngineRequest
from pocketllm.server.app import ServerConfig, build_app
from pocketllm.server.exposure import ExposurePolicy
from pocketllm.server.serving import OpenAIServing, sse

BASE = "http://127.0.0.1:8000"


class StubEngine:
    """Just enough of ``AsyncLLM`` for requests that never reach an engine: its request builder blocks on
    ``release`` for the prompt "slow" (and says whether it is inside), and raises for "boom"."""

    max_model_len = 64
    tokenizer = None
    engine_error = None

    def __init__(self) -> None:
        self.request_builder = self
        self.entered = threading.Event()
        self.release = threading.Event()
        self.inside = False
        self.build_thread: threading.Thread | None = None

    def engine_caps(self) -> SimpleNamespace:
        return SimpleNamespace(details={"vocab_size": 100})

    def stats(self) -> None:
        return None

    def cancel(self, engine_id: str) -> None:
        pass

    def build(self, params, *, prompt=None, messages=None, chat_options=None, strict_budget=False) -> EngineRequest:
        self.build_thread = threading.current_thread()
        if prompt == "boom":
            raise RuntimeError("a bug")
        if prompt == "slow":
            self.inside = True
            self.entered.set()
            released = self.release.wait(10)
            self.inside = False
            raise InvalidRequestError("the prompt is too long" if released else "never released", param="prompt")
        return EngineRequest([1, 2, 3], dataclasses.replace(params, max_tokens=params.max_tokens or 4))


def _app(engine: StubEngine | None = None, **config):
    """The app with ``engine`` in place of a loaded model (no lifespan runs, so nothing loads)."""
    app = build_app(ServerConfig(EngineArgs(model=config.pop("model", None)), **config))
    if engine is not None:
        state = app.state.pocketllm
        state.llm = engine
        state.serving = OpenAIServing(engine, state.model_name, state.metrics, None)
    return app


def _client(app, base: str = BASE) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url=base)


def _run(coro):
    return asyncio.run(coro)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- body size --------------------------------------------------------------------------------------

async def _raw(app, headers: list[tuple[bytes, bytes]], chunks) -> tuple[int, dict, int]:
    """Call the ASGI app directly: (status, JSON body, how many body chunks it pulled)."""
    import json

    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {"type": "http.request", "body": chunks[pulled - 1], "more_body": pulled < len(chunks)}
        await asyncio.Event().wait()   # nothing more (a disconnect never comes)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1:8000"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "state": {}}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), pulled


def test_a_declared_length_over_the_limit_is_a_413_before_any_byte_is_read() -> None:
    app = _app(StubEngine(), max_request_bytes=1000)
    status, body, pulled = _run(_raw(app, [(b"content-length", b"20000000")], [b"x" * 1000] * 3))
    assert status == 413 and pulled == 0
    assert body["error"]["type"] == "invalid_request_error" and "1000 bytes" in body["error"]["message"]


def test_a_chunked_body_is_counted_and_refused_once_past_the_limit() -> None:
    app = _app(StubEngine(), max_request_bytes=3 << 20)
    chunks = [b" " * (1 << 20)] * 10   # 10 MiB without a Content-Length
    status, body, pulled = _run(_raw(app, [(b"transfer-encoding", b"chunked")], chunks))
    assert status == 413 and pulled == 4   # nothing read after the chunk that passed the limit
    assert "larger than 3145728 bytes" in body["error"]["message"]


def test_a_body_within_the_limit_is_served() -> None:
    async def main() -> httpx.Response:
        async with _client(_app(StubEngine(), max_request_bytes=1000)) as client:
            return await client.post("/v1/completions", json={"prompt": "slow" + " " * 2000})
    assert _error(_run(main()), 413)
    engine = StubEngine()
    engine.release.set()

    async def small() -> httpx.Response:
        async with _client(_app(engine, max_request_bytes=1000)) as client:
            return await client.post("/v1/completions", json={"prompt": "slow"})
    assert _error(_run(small()), 400)["param"] == "prompt"


# --- off the event loop -----------------------------------------------------------------------------

def test_health_answers_while_a_prompt_is_being_encoded() -> None:
    engine = StubEngine()
    app = _app(engine)

    async def main() -> tuple[httpx.Response, bool, httpx.Response]:
        async with _client(app) as client:
            post = asyncio.create_task(client.post("/v1/completions", json={"prompt": "slow"}))
            assert await asyncio.to_thread(engine.entered.wait, 30)
            health = await client.get("/health")
            encoding_meanwhile = engine.inside
            engine.release.set()
            return health, encoding_meanwhile, await post

    health, encoding_meanwhile, refused = _run(main())
    assert health.status_code == 200 and encoding_meanwhile
    assert engine.build_thread is not threading.main_thread()
    assert "too long" in _error(refused, 400)["message"]


def test_an_unexpected_exception_is_a_500_in_the_openai_shape() -> None:
    async def main() -> httpx.Response:
        async with _client(_app(StubEngine())) as client:
            return await client.post("/v1/completions", json={"prompt": "boom"})
    error = _error(_run(main()), 500)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]


# --- Host and Origin --------------------------------------------------------------------------------

LOOPBACK_POLICY = ExposurePolicy.build("127.0.0.1")


@pytest.mark.parametrize(("host", "origin", "status"), [
    ("127.0.0.1:8000", None, 200),
    ("localhost:8000", None, 200),
    ("[::1]:8000", None, 200),
    ("127.0.0.2", None, 200),
    ("LOCALHOST", None, 200),
    ("attacker.example:8000", None, 403),
    ("localhost.attacker.example", None, 403),
    ("127.0.0.1:8000", "http://127.0.0.1:8000", 200),
    ("127.0.0.1:8000", "http://attacker.example", 403),
    ("127.0.0.1:8000", "http://localhost:8000", 403),    # another origin, even a loopback one
    ("127.0.0.1:8000", "null", 403),
])
def test_host_and_origin_checks_on_loopback(host: str, origin: str | None, status: int) -> None:
    headers = {"Host": host, **({"Origin": origin} if origin else {})}

    async def main() -> httpx.Response:
        async with _client(_app(exposure=LOOPBACK_POLICY)) as client:
            return await client.get("/health", headers=headers)
    response = _run(main())
    if status == 403:
        assert _error(response, 403)["type"] == "permission_error"
    else:
        assert response.status_code == status, response.text


def test_exposure_policy_flags() -> None:
    policy = ExposurePolicy.build("127.0.0.1", allowed_hosts=["box.lan,other.lan"],
                                  allowed_origins=["http://localhost:3000"])
    assert policy.host_refusal("box.lan:8000") is None and policy.host_refusal("other.lan") is None
    assert policy.host_refusal("evil.lan") is not None and policy.host_refusal("localhost") is None
    assert policy.origin_refusal("http://localhost:3000/", "127.0.0.1:8000") is None
    assert policy.origin_refusal("http://localhost:3001", "127.0.0.1:8000") is not None
    anywhere = ExposurePolicy.build("127.0.0.1", allowed_hosts=["*"], allowed_origins=["*"])
    assert anywhere.host_refusal("evil.lan") is None and anywhere.origin_refusal("http://evil", "x") is None
    # Bound elsewhere, or with an API key: no Host check unless names are given; the Origin check stays.
    public = ExposurePolicy.build("0.0.0.0")
    assert public.host_refusal("evil.lan") is None and public.origin_refusal("http://evil", "box:1") is not None
    keyed = ExposurePolicy.build("127.0.0.1", check_hosts=False)
    assert keyed.host_refusal("evil.lan") is None
    assert ExposurePolicy.build("0.0.0.0", allowed_hosts=["box.lan"]).host_refusal("evil.lan") is not None
    assert policy.host_refusal(None) is None and policy.origin_refusal(None, "x") is None   # not a browser


# --- the served name --------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "served", "name"), [
    ("/srv/models/SmolLM2-135M-Instruct-Q4_1.gguf", None, "SmolLM2-135M-Instruct-Q4_1"),
    ("/srv/models/Qwen3-0.6B/", None, "Qwen3-0.6B"),
    ("relative/dir/Llama-3-8B", None, "Llama-3-8B"),
    ("/srv/models/x.gguf", "mine", "mine"),
    (None, None, "pocketllm-default"),
])
def test_the_served_name_is_never_a_path(model: str | None, served: str | None, name: str) -> None:
    async def main() -> tuple[dict, dict]:
        async with _client(_app(model=model, served_model_name=served)) as client:
            return (await client.get("/health")).json(), (await client.get("/v1/models")).json()
    health, models = _run(main())
    assert health["model"] == name and models["data"][0]["id"] == name


# --- answers the app does not give --------------------------------------------------------------------

@pytest.mark.parametrize("failure", ["raises", "returns"])
def test_an_app_that_fails_or_returns_before_answering_is_a_500_in_the_openai_shape(failure: str) -> None:
    """The guard the server's HTTP protocol puts around the app answers for it (uvicorn would send text)."""
    from pocketllm.server.http_protocol import AnswerGuard

    async def broken(scope, receive, send) -> None:
        if failure == "raises":
            raise RuntimeError("a bug")

    async def main() -> httpx.Response:
        async with _client(AnswerGuard(broken)) as client:
            return await client.get("/health")
    error = _error(_run(main()), 500)
    assert error["type"] == "server_error"
    assert ("RuntimeError" if failure == "raises" else "no answer") in error["message"]


def test_sse_events_are_utf8_with_lone_surrogates_escaped():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    event = sse({"delta": {"content": "café 日本"}})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"delta": {"content": "café 日本"}}
    assert "café 日本".encode() in event                     # written as UTF-8, not escaped
    lone = sse({"delta": {"content": "a\ud800b"}})
    lone.decode("utf-8")                                        # valid UTF-8 all the same
    assert b"\\ud800" in lone and json.loads(lone[6:])["delta"]["content"] == "a\ud800b"


# --- request bodies that cannot be read ---------------------------------------------------------------

def test_an_integer_of_more_than_4300_digits_is_a_400() -> None:
    """Python's int() refuses such a literal (ValueError): the body is malformed JSON, not a server error."""
    async def main() -> httpx.Response:
        async with _client(_app(StubEngine())) as client:
            return await client.post("/v1/completions", content=b'{"prompt":"a","max_tokens":' + b"9" * 5000 + b"}",
                                     headers={"content-type": "application/json"})
    error = _error(_run(main()), 400)
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]


def test_a_client_gone_while_sending_its_body_ends_the_request_without_an_exception() -> None:
    """A disconnect while the body is read raises nothing out of the app (uvicorn would log a traceback)."""
    messages = [{"type": "http.request", "body": b'{"prompt"', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": {}}
    _run(_app(StubEngine())(scope, receive, send))
    assert not messages and sent[0]["type"] == "http.response.start"


# --- routes ---------------------------------------------------------------------------------------------

def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_a_404() -> None:
    from fastapi.testclient import TestClient
    from openai import NotFoundError, OpenAI

    for name in ("tiny", "org/tiny-model"):
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                        http_client=TestClient(_app(StubEngine(), served_model_name=name)))
        listed = client.models.list().data[0]
        retrieved = client.models.retrieve(name)
        assert retrieved.id == name and retrieved.model_dump() == listed.model_dump()
        assert retrieved.model_extra == {"max_model_len": StubEngine.max_model_len}
        with pytest.raises(NotFoundError) as caught:
            client.models.retrieve("gpt-4o")
        error = _error(caught.value.response, 404)
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4o" in error["message"]


@pytest.mark.parametrize("path", ["/health", "/alive", "/ready", "/metrics", "/v1/models", "/v1/models/tiny"])
def test_get_routes_answer_head_too(path: str) -> None:
    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with _client(_app(StubEngine(), served_model_name="tiny")) as client:
            return await client.get(path), await client.head(path)
    got, head = _run(main())
    assert head.status_code == got.status_code == 200
    assert head.headers["content-type"] == got.headers["content-type"]


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/"),
                                              ("POST", "/v1/responses/"), ("GET", "/v1/models/"),
                                              ("GET", "/health/")])
def test_a_trailing_slash_is_a_404_in_the_openai_shape(method: str, path: str) -> None:
    async def main() -> httpx.Response:
        async with _client(_app(StubEngine())) as client:
            return await client.request(method, path, json={"prompt": "hi"})
    assert _error(_run(main()), 404)["type"] == "not_found_error"


# --- behind uvicorn: requests cut short or never ending, header bytes -----------------------------------

READ_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[int, uvicorn.Server]]:
    """(port, server): the stub app behind uvicorn as ``pocketllm serve`` configures it, with a read timeout of
    ``READ_TIMEOUT`` seconds and a 1,000-byte body limit; uvicorn leaves logging to pytest."""
    from pocketllm.cli.listen import listen_socket
    from pocketllm.server.http_protocol import uvicorn_config

    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn_config(_app(StubEngine(), max_request_bytes=1000), read_timeout=READ_TIMEOUT,
                            lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1], server
    server.should_exit = True
    thread.join(30)
    sock.close()


def _exchange(port: int, *parts: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Send ``parts`` (``pause`` seconds apart) without closing the sending side and read until the server
    closes the connection: (everything read, seconds from connecting to the close)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT + 10) as sock:
        for part in parts:
            sock.sendall(part)
            time.sleep(pause)
        reply = b""
        while data := sock.recv(65536):
            reply += data
    return reply, time.monotonic() - started


def _status_and_error(reply: bytes) -> tuple[int, dict, bytes]:
    """(status, the OpenAI error, the head) of a reply holding one error response."""
    head, _, body = reply.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return int(head.split(b" ")[1]), error, head.lower()


def _wait_for_requests_to_end(server: uvicorn.Server) -> None:
    deadline = time.monotonic() + 10
    while server.server_state.tasks:
        assert time.monotonic() < deadline, "a request task did not end"
        time.sleep(0.01)


def test_a_connection_that_sends_nothing_is_closed_after_the_read_timeout(served) -> None:
    reply, seconds = _exchange(served[0])
    assert reply == b"" and READ_TIMEOUT * 0.9 <= seconds < READ_TIMEOUT + 3


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n",   # headers that never end
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"prompt\"",   # a short body
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
], ids=["headers", "content-length", "chunked"])
def test_a_request_not_whole_within_the_read_timeout_is_a_408_and_closed(served, request_bytes, caplog) -> None:
    port, server = served
    with caplog.at_level(logging.DEBUG):
        reply, seconds = _exchange(port, request_bytes)
        _wait_for_requests_to_end(server)
    status, error, head = _status_and_error(reply)
    assert status == 408 and error["type"] == "invalid_request_error" and b"connection: close" in head
    assert READ_TIMEOUT * 0.9 <= seconds < READ_TIMEOUT + 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text   # no traceback


def test_the_read_timeout_starts_afresh_for_each_request_of_a_connection(served) -> None:
    """Two requests on one connection, each sent 0.6 of the timeout after the previous answer's start."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    last = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    reply, _ = _exchange(served[0], b"", request, last, pause=READ_TIMEOUT * 0.6)
    assert reply.count(b"HTTP/1.1 200 OK") == 2, reply


def test_a_client_gone_while_sending_its_body_leaves_no_traceback(served, caplog) -> None:
    port, server = served
    # (the server's logger by name: a CLI test in the same process may have set the "pocketllm" logger's level)
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="pocketllm.server"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{}")
            time.sleep(0.2)   # the request has started and waits for the rest of its body
        _wait_for_requests_to_end(server)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "went away before its request body arrived" in caplog.text


def test_a_chunked_body_past_the_limit_is_a_413_that_closes_the_connection(served) -> None:
    chunk = b"%x\r\n%s\r\n" % (600, b" " * 600)
    reply, seconds = _exchange(served[0], b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                          b"Transfer-Encoding: chunked\r\n\r\n" + chunk + chunk)
    status, error, head = _status_and_error(reply)
    assert status == 413 and b"connection: close" in head and "1000 bytes" in error["message"]
    assert seconds < READ_TIMEOUT * 0.9   # closed at once, not by the read timeout


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x08b", b"a\x1fb", b"a\x7fb", b"a\x0bb", b"\x1b[31m"])
def test_a_header_holding_a_control_byte_is_a_400(served, value: bytes) -> None:
    reply, _ = _exchange(served[0], b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Test: " + value + b"\r\n\r\n")
    status, error, head = _status_and_error(reply)
    assert status == 400 and error["type"] == "invalid_request_error" and b"connection: close" in head


@pytest.mark.parametrize("header", [b"X-Test: caf\xc3\xa9 \xff", b"X-Test: a\tb", b"X-Test: a\r\n b"],
                         ids=["obs-text", "tab", "obs-fold"])
def test_obs_text_tabs_and_folded_header_lines_are_read(served, header: bytes) -> None:
    reply, _ = _exchange(served[0], b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header +
                         b"\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 OK"), reply[:300]


@pytest.mark.parametrize("request_bytes,version", [
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/2"),   # the preface of HTTP/2 with prior knowledge
    (b"GET /health HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n", "HTTP/3"),
], ids=["http2-preface", "http3"])
def test_another_http_version_is_one_505_that_closes_the_connection(served, request_bytes, version) -> None:
    """A request line of HTTP/2 or later gets one refusal naming HTTP/1.1 (the HTTP/2 preface got a 404 for
    ``*``, then a 400 for its ``SM`` line)."""
    reply, seconds = _exchange(served[0], request_bytes)
    assert reply.startswith(b"HTTP/1.1 505 ") and reply.count(b"\r\n\r\n") == 1, reply   # one response
    status, error, head = _status_and_error(reply)
    assert status == 505 and error["type"] == "invalid_request_error" and b"connection: close" in head
    assert f"{version} is not supported" in error["message"] and "HTTP/1.1" in error["message"]
    assert seconds < READ_TIMEOUT * 0.9   # closed at once, not by the read timeout
