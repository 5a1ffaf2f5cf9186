"""The HTTP surface: thin routes over ``OpenAIServing``; the listener is up before the model has loaded."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pocketllm.api import AsyncLLM
from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError, PocketLLMError, UnsupportedFeatureError
from pocketllm.protocol.openai_fields import parse_chat_request, parse_completion_request
from pocketllm.server.errors import error_response
from pocketllm.server.metrics import ServerMetrics
from pocketllm.server.serving import OpenAIServing, RequestFailed

logger = logging.getLogger("pocketllm.server")


@dataclass(frozen=True)
class ServerConfig:
    engine_args: EngineArgs
    served_model_name: str | None = None
    api_key: str | None = None
    request_timeout: float | None = None


@dataclass
class ServerState:
    """What the routes share: the engine once loaded, and whether the server is draining."""

    config: ServerConfig
    llm: AsyncLLM | None = None
    serving: OpenAIServing | None = None
    load_error: BaseException | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)
    metrics: ServerMetrics | None = None

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.engine_args.model or "pocketllm-default"


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on /v1/* (plain ASGI, so disconnects still reach handlers)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _load(state: ServerState) -> None:
    try:
        state.llm = AsyncLLM(state.config.engine_args)
        state.serving = OpenAIServing(state.llm, state.model_name, state.metrics, state.config.request_timeout)
        logger.info("model loaded; ready")
    except BaseException as exc:  # reported by /ready and every /v1 call
        logger.exception("model load failed")
        state.load_error = exc


def build_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)
    state.metrics = ServerMetrics(lambda: state.llm.stats() if state.llm is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The model loads in a worker thread so the listener answers /alive and /ready at once.
        app.state.load_task = asyncio.get_running_loop().run_in_executor(None, _load, state)
        yield

    app = FastAPI(title="PocketLLM", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.pocketllm = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return error_response(404, f"no route for {request.method} {request.url.path}")
        if exc.status_code == 404:
            return error_response(404, f"no route for {request.method} {request.url.path}")
        return error_response(exc.status_code, str(exc.detail))

    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key)

    def _unavailable() -> JSONResponse | None:
        if state.load_error is not None:
            return error_response(503, f"the model failed to load: {state.load_error}")
        if state.serving is None:
            return error_response(503, "the model is still loading; retry when /ready answers 200")
        if state.draining:
            return error_response(503, "the server is shutting down")
        return None

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "error" if state.load_error else ("ok" if state.serving else "loading")
        return JSONResponse({"status": status, "model": state.model_name},
                            status_code=200 if state.load_error is None else 503)

    @app.get("/alive")
    async def alive() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        problem = _unavailable()
        return problem if problem is not None else JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "pocketllm",
             "max_model_len": state.llm.max_model_len if state.llm else None}]})

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError("the request body is nested too deeply to read") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return body

    async def _serve(request: Request, endpoint: str) -> Response:
        problem = _unavailable()
        if problem is not None:
            return problem
        serving = state.serving
        try:
            body = await _body(request)
            caps = state.llm.engine_caps()
            if endpoint == "chat":
                parsed, prefix = parse_chat_request(body, caps), "chatcmpl"
            else:
                parsed, prefix = parse_completion_request(body, caps), "cmpl"
            if parsed.stream:
                job = serving.prepare_stream(parsed, prefix)
                return StreamingResponse(serving.stream(job), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
            return JSONResponse(await serving.complete(parsed, prefix, request.is_disconnected))
        except (InvalidRequestError, UnsupportedFeatureError) as exc:
            return error_response(400, str(exc), getattr(exc, "param", None))
        except RequestFailed as exc:
            return error_response(exc.status, exc.message)
        except PocketLLMError as exc:
            return error_response(500, str(exc))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completions")

    @app.delete("/v1/requests/{request_id}")
    async def cancel_request(request_id: str) -> JSONResponse:
        if state.serving is None or not state.serving.cancel(request_id):
            return error_response(404, f"no active request with id {request_id!r}", param="request_id")
        return JSONResponse({"id": request_id, "object": "request.cancelled", "cancelled": True})

    return app
