"""``pocketllm host``: the harness over WebSocket on loopback, plus the web client on the same port.

Every connection first presents the shared token (``{"op":"auth","token":…}``, compared in constant time);
anything else, or a wrong token, is answered with an error and the connection is closed. Each connection
may hold several sessions; all of them share the engine's continuous batching.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import mimetypes
import os
import socket
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pocketllm.config import EngineArgs
from pocketllm.harness.lifecycle import LOOPBACK, StopSignals, display_name, run_until_done, say
from pocketllm.harness.protocol import MAX_LINE_BYTES, ProtocolError, encode, error_line, parse_line
from pocketllm.harness.service import Channel, Harness
from pocketllm.harness.sessions import SessionStore
from pocketllm.server.exposure import ExposurePolicy

logger = logging.getLogger("pocketllm.harness")

AUTH_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0
# A message over MAX_LINE_BYTES is read, then refused with an error line like an overlong line on the pipe (the
# connection carries on); the library reads one up to MAX_MESSAGE_BYTES and closes the connection (code 1009) on a
# larger one unread. At most MAX_QUEUED_FRAMES frames wait to be handled before reading pauses, so what one connection
# holds stays under about (MAX_QUEUED_FRAMES + 1) x MAX_MESSAGE_BYTES.
MAX_MESSAGE_BYTES = 2 * MAX_LINE_BYTES
MAX_QUEUED_FRAMES = 4
# Connections not yet authenticated, at most; a newcomer past it closes the oldest (code 1013). They do not count
# towards --max-conns, so a process without the token cannot hold the slots of the clients that have it.
MAX_PENDING_AUTH = 32
CLOSE_POLICY = 1008          # policy violation: not authenticated
CLOSE_TRY_AGAIN = 1013       # try again later: connection limit
# The built-in client loads nothing from elsewhere and runs no inline script.
BUILTIN_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
               "connect-src 'self' ws://127.0.0.1:* ws://localhost:*; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")


@dataclass
class HostConfig:
    engine_args: EngineArgs
    port: int = 8850
    token: str = ""
    max_conns: int = 16
    idle_expiry_ms: int = 600_000
    kv_store: str | None = None
    web_dir: str | None = None
    sock: socket.socket | None = None   # a listening socket already bound (by the CLI, before loading anything)
    allowed_hosts: tuple[str, ...] = ()     # Host names answered besides loopback ones ("*": any)
    allowed_origins: tuple[str, ...] = ()   # web origins that may open a WebSocket besides the host's own


def builtin_web_dir() -> str:
    return str(resources.files("pocketllm.harness") / "web")


class StaticFiles:
    """GET of files under one directory (``/`` is ``index.html``); nothing outside it is reachable."""

    def __init__(self, root: str, csp: str | None) -> None:
        self.root = os.path.realpath(root)
        self.csp = csp

    def lookup(self, path: str) -> str | None:
        path = path.split("?", 1)[0].split("#", 1)[0]
        if path in ("", "/"):
            path = "/index.html"
        if "\\" in path or "\x00" in path:
            return None
        full = os.path.realpath(os.path.join(self.root, path.lstrip("/")))
        if not full.startswith(self.root + os.sep) or not os.path.isfile(full):
            return None
        return full

    def respond(self, connection, request):
        full = self.lookup(request.path)
        if full is None:
            return connection.respond(404, "not found\n")
        with open(full, "rb") as handle:
            body = handle.read()
        response = connection.respond(200, "")
        kind = mimetypes.guess_type(full)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind in ("application/javascript", "application/json"):
            kind += "; charset=utf-8"
        headers = response.headers
        for name in ("Content-Type", "Content-Length"):
            del headers[name]
        headers["Content-Type"] = kind
        headers["Content-Length"] = str(len(body))
        headers["Cache-Control"] = "no-cache"
        headers["X-Content-Type-Options"] = "nosniff"
        headers["Referrer-Policy"] = "no-referrer"
        if self.csp:
            headers["Content-Security-Policy"] = self.csp
        response.body = body
        return response


class Host:
    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.token = config.token.encode("utf-8")
        self.stop = asyncio.Event()
        store = SessionStore(config.kv_store) if config.kv_store else None
        expiry = config.idle_expiry_ms / 1000 if config.idle_expiry_ms > 0 else None
        self.harness = Harness(config.engine_args, store=store, idle_expiry_s=expiry, on_shutdown=self.stop.set)
        web = config.web_dir or builtin_web_dir()
        self.static = StaticFiles(web, None if config.web_dir else BUILTIN_CSP)
        self.connections: set[Any] = set()
        self.pending: dict[Any, None] = {}   # connections waiting to authenticate, oldest first
        self._names = itertools.count(1)
        self.exposure = ExposurePolicy.build(LOOPBACK, allowed_hosts=config.allowed_hosts,
                                             allowed_origins=config.allowed_origins)

    def check_token(self, token: Any) -> bool:
        # (surrogatepass: a token holding a lone surrogate is just a wrong one, not an error)
        given = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b""
        return hmac.compare_digest(given, self.token)

    def _http(self, connection, request):
        """Requests for a foreign ``Host`` (DNS rebinding) and WebSocket upgrades from a foreign ``Origin`` (another
        site's page) are refused with a 403; plain HTTP requests get the web client; WebSocket upgrades go on to
        the handshake (and the token)."""
        host = request.headers.get("Host")
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        problem = self.exposure.host_refusal(host)
        if problem is None and upgrade:
            problem = self.exposure.origin_refusal(request.headers.get("Origin"), host)
        if problem is not None:
            logger.warning("refused a request: %s", problem)
            return connection.respond(403, problem + "\n")
        if upgrade:
            return None
        return self.static.respond(connection, request)

    async def _handler(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        async def write(line: str) -> None:
            await ws.send(line)

        async def send(obj: dict[str, Any]) -> None:
            await write(encode(obj))

        if self.harness.draining:
            await send(error_line("the host is shutting down"))
            await ws.close(1001, "shutting down")
            return
        if len(self.pending) >= MAX_PENDING_AUTH:
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            logger.warning("closed a connection that had not authenticated: %d were waiting", MAX_PENDING_AUTH)
            asyncio.ensure_future(oldest.close(CLOSE_TRY_AGAIN, "too many connections waiting to authenticate"))
        name = f"c{next(self._names)}"
        channel = Channel(name, write, check_token=self.check_token, gone=(ConnectionClosed,),
                          on_bad_token=lambda: asyncio.ensure_future(ws.close(CLOSE_POLICY, "wrong token")))
        self.pending[ws] = None
        try:
            try:
                if not await self._authenticate(ws, send):
                    return
            finally:
                self.pending.pop(ws, None)
            logger.info("connection %s authenticated", name)
            while True:   # until the connection closes (ConnectionClosed)
                await self.harness.handle(channel, await ws.recv(decode=False))   # bytes: parse_line measures them
        except Exception as exc:  # a dropped connection ends here; the host carries on
            logger.debug("connection %s ended: %r", name, exc)
        finally:
            self.connections.discard(ws)
            self.harness.detach(channel)

    async def _authenticate(self, ws, send) -> bool:
        try:
            first = await asyncio.wait_for(ws.recv(decode=False), AUTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            await send(error_line(f"no auth within {AUTH_TIMEOUT_S:.0f} s"))
            await ws.close(CLOSE_POLICY, "auth timeout")
            return False
        request_id = None
        try:
            op = parse_line(first)
            request_id = op.id
            if op.op != "auth":
                raise ProtocolError('authenticate first: send {"op":"auth","token":"…"}', op.id)
        except ProtocolError as exc:
            await send(error_line(exc.message if "authenticate" in exc.message else
                                  f'authenticate first: send {{"op":"auth","token":"…"}} ({exc.message})',
                                  exc.request_id))
            await ws.close(CLOSE_POLICY, "not authenticated")
            return False
        if not self.check_token(op.get("token")):
            logger.warning("refused a connection: wrong token")
            await send(error_line("wrong token", request_id))
            await ws.close(CLOSE_POLICY, "wrong token")
            return False
        if len(self.connections) >= self.config.max_conns:   # (counted once authenticated: see MAX_PENDING_AUTH)
            logger.warning("refused a connection: %d already open (--max-conns)", len(self.connections))
            await send(error_line(f"too many connections: this host allows {self.config.max_conns} at once "
                                  "(--max-conns); close one or try again later", request_id))
            await ws.close(CLOSE_TRY_AGAIN, "too many connections")
            return False
        self.connections.add(ws)   # (before the reply is awaited: a second client checks against it)
        await send({"id": request_id, "auth": "ok"})
        return True

    async def _load(self) -> None:
        started = time.monotonic()
        await self.harness.load()
        say(f"ready: {display_name(self.config.engine_args.model)} (load {time.monotonic() - started:.1f} s)")

    async def run(self) -> int:
        from websockets.asyncio.server import serve

        signals = StopSignals(self.harness.begin_shutdown)
        signals.install(asyncio.get_running_loop())
        sock = self.config.sock   # bound already (the CLI's), else bound here
        server = await serve(self._handler, None if sock else LOOPBACK, None if sock else self.config.port, sock=sock,
                             process_request=self._http, max_size=MAX_MESSAGE_BYTES, max_queue=MAX_QUEUED_FRAMES,
                             compression=None)
        loader = asyncio.create_task(self._load())
        loader.add_done_callback(lambda task: task.cancelled() or task.exception() is None or self.stop.set())
        await self.stop.wait()
        server.close(close_connections=False)   # no new connections; open ones see their requests finish
        await self.harness.drain(DRAIN_TIMEOUT_S)
        closing = [asyncio.ensure_future(ws.close(1001, "host shutting down")) for ws in list(self.connections)]
        if closing:
            await asyncio.wait(closing, timeout=5)
        await asyncio.wait_for(server.wait_closed(), 10)
        status = 0
        if loader.done() and not loader.cancelled() and loader.exception() is not None:
            say(f"pocketllm: error: the model failed to load: {loader.exception()}")
            status = 1
        elif not loader.done():
            loader.cancel()   # its thread is left to the process's exit (pocketllm.cli.exits)
        await self.harness.close()
        return signals.exit_status(status)


def run_host(config: HostConfig) -> int:
    """Serve until the ``shutdown`` operation, SIGTERM (status 0) or SIGINT (130); 1 if the model failed to load."""
    return run_until_done(Host(config).run())
