"""The server's edge, in process over a stub engine: body size limit, Host/Origin checks, the served name, the
catch-all error shape, and prompts encoded off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

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
