"""The HTTP surface: thin routes over ``OpenAIServing``; the listener is up before the model has loaded."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pocketllm.api import AsyncLLM
from pocketllm.config import EngineArgs
from pocketllm.errors import EngineDeadError, InvalidRequestError, PocketLLMError, UnsupportedFeatureError
from pocketllm.protocol.openai_fields import parse_chat_request, parse_completion_request
from pocketllm.protocol.responses_request import ResponsesRequest, parse_responses_request
from pocketllm.server.errors import JSONResponse, error_response
from pocketllm.server.exposure import ExposurePolicy
from pocketllm.server.guards import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware, ExposureMiddleware
from pocketllm.server.metrics import ServerMetrics
from pocketllm.server.responses import ResponsesServing
from pocketllm.server.serving import OpenAIServing, RequestFailed

logger = logging.getLogger("pocketllm.server")
access_logger = logging.getLogger("pocketllm.access")


@dataclass(frozen=True)
class ServerConfig:
    engine_args: EngineArgs
    served_model_name: str | None = None
    api_key: str | None = None
    request_timeout: float | None = None
    access_log: bool = False   # one line a request on the "pocketllm.access" logger
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    exposure: ExposurePolicy = ExposurePolicy()   # no Host/Origin checks unless the CLI builds a policy
    # Called on the loading thread once the model has loaded or failed to (``load_error``).
    on_loaded: Callable[[ServerState], None] | None = field(default=None, compare=False)


@dataclass
class ServerState:
    """What the routes share: the engine once loaded, and whether the server is draining."""

    config: ServerConfig
    llm: AsyncLLM | None = None
    serving: OpenAIServing | None = None
    load_error: BaseException | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)
    load_seconds: float | None = None
    metrics: ServerMetrics | None = None

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or default_model_name(self.config.engine_args.model)


def default_model_name(model: str | None) -> str:
    """The name a model is served under without ``--served-model-name``: the checkpoint's file or directory
    name (without ``.gguf``), never its path."""
    if model is None:
        return "pocketllm-default"
    name = os.path.basename(os.path.normpath(model))
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


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


class AccessLogMiddleware:
    """One line a request: client, method, path, status and the time until the response (a stream: its end)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 0   # no response started (the client went away first)

        async def send_logged(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            client = scope.get("client")
            access_logger.info('%s "%s %s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-",
                               scope["method"], scope["path"], status, (time.monotonic() - started) * 1000)


def served_engine_args(args: EngineArgs) -> EngineArgs:
    """The server's engine arguments: ``engine_process`` unset becomes on for CUDA (the engine's steps then
    never wait on the HTTP front end for the interpreter lock) and off on CPU and under tensor parallelism."""
    if args.engine_process is not None or args.tensor_parallel_size > 1:
        return args
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return args.replace(engine_process=device == "cuda")


def _load(state: ServerState) -> None:
    started = time.monotonic()
    try:
        llm = AsyncLLM(served_engine_args(state.config.engine_args))
        if state.draining:   # stopped while loading (the process is exiting): never serve it
            logger.info("model loaded after shutdown began; discarded")
            asyncio.run(llm.shutdown())
            return
        state.llm = llm
        state.serving = OpenAIServing(state.llm, state.model_name, state.metrics, state.config.request_timeout)
        state.load_seconds = time.monotonic() - started
        logger.info("model loaded; ready")
    except BaseException as exc:  # reported by /ready and every /v1 call
        logger.debug("model load failed", exc_info=True)
        if state.config.on_loaded is None:
            logger.error("the model failed to load: %s", exc)
        state.load_error = exc
    if state.config.on_loaded is not None:
        state.config.on_loaded(state)


def build_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)
    state.metrics = ServerMetrics(lambda: state.llm.stats() if state.llm is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The model loads in a thread so the listener answers /alive and /ready at once; a daemon thread, so
        # that a server stopped while it loads does not wait for it.
        app.state.load_thread = threading.Thread(target=_load, args=(state,), name="pocketllm-load", daemon=True)
        app.state.load_thread.start()
        yield

    # redirect_slashes off: a path with a trailing slash is a 404 in the OpenAI shape, never a bare redirect.
    app = FastAPI(title="PocketLLM", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  redirect_slashes=False)
    app.state.pocketllm = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return error_response(404, f"no route for {request.method} {request.url.path}")
        if exc.status_code == 404:
            return error_response(404, f"no route for {request.method} {request.url.path}")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")

    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes)
    app.add_middleware(ExposureMiddleware, policy=config.exposure)
    if config.access_log:   # added last, so outermost: refused requests are logged too
        app.add_middleware(AccessLogMiddleware)

    def _unavailable() -> JSONResponse | None:
        if state.load_error is not None:
            return error_response(503, f"the model failed to load: {state.load_error}")
        if state.serving is None:
            return error_response(503, "the model is still loading; retry when /ready answers 200")
        if state.draining:
            return error_response(503, "the server is shutting down")
        if state.llm is not None and state.llm.engine_error is not None:
            return error_response(503, f"the engine has stopped: {state.llm.engine_error}")
        return None

    def get(path: str) -> Callable[[Callable], Callable]:
        """A GET route that answers HEAD too (the same status and headers; uvicorn sends no body)."""
        return app.api_route(path, methods=["GET", "HEAD"])

    @get("/health")
    async def health() -> JSONResponse:
        failed = state.load_error is not None or (state.llm is not None and state.llm.engine_error is not None)
        status = "error" if failed else ("ok" if state.serving else "loading")
        return JSONResponse({"status": status, "model": state.model_name}, status_code=503 if failed else 200)

    @get("/alive")
    async def alive() -> JSONResponse:
        return JSONResponse({"status": "alive"})

    @get("/ready")
    async def ready() -> JSONResponse:
        problem = _unavailable()
        return problem if problem is not None else JSONResponse({"status": "ready"})

    @get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        """The served model as an OpenAI model object, with its ``max_model_len``."""
        return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "pocketllm",
                "max_model_len": state.llm.max_model_len if state.llm else None}

    @get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != state.model_name:
            return error_response(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:   # not JSON, not UTF-8, or an integer of more than 4,300 digits
            raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError("the request body is nested too deeply to read") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return body

    async def _respond(request: Request, parsed: ResponsesRequest) -> Response:
        """A /v1/responses answer: the whole response, or its stream of typed events."""
        responses = ResponsesServing(state.serving)
        if parsed.chat.stream:
            job = await responses.prepare_stream(parsed)
            return StreamingResponse(responses.stream(job, parsed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
        return JSONResponse(await responses.create(parsed, request.is_disconnected))

    async def _serve(request: Request, endpoint: str) -> Response:
        problem = _unavailable()
        if problem is not None:
            return problem
        serving = state.serving
        try:
            body = await _body(request)
            caps = state.llm.engine_caps()
            if endpoint == "responses":
                return await _respond(request, parse_responses_request(body, caps))
            if endpoint == "chat":
                parsed, prefix = parse_chat_request(body, caps), "chatcmpl"
            else:
                parsed, prefix = parse_completion_request(body, caps), "cmpl"
            if parsed.stream:
                job = await serving.prepare_stream(parsed, prefix)
                return StreamingResponse(serving.stream(job), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
            return JSONResponse(await serving.complete(parsed, prefix, request.is_disconnected))
        except (InvalidRequestError, UnsupportedFeatureError) as exc:
            return error_response(400, str(exc), getattr(exc, "param", None))
        except RequestFailed as exc:
            return error_response(exc.status, exc.message)
        except EngineDeadError as exc:
            return error_response(503, str(exc))
        except PocketLLMError as exc:
            return error_response(500, str(exc))
        except ClientDisconnect:   # gone while sending its body: the answer reaches no one
            logger.debug("the client went away before its request body arrived")
            return error_response(400, "the client disconnected before its request body arrived")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _serve(request, "responses")

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
