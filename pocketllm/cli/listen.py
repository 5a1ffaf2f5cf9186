"""The listening socket of ``serve`` and ``host``, bound before anything slow runs (a busy port is one line
and an exit at once, not a traceback after the model has loaded), and their flags for who may reach it."""

from __future__ import annotations

import argparse
import errno
import socket

BACKLOG = 2048


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port`` 0: one the system picks); the server is handed it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise SystemExit(f"pocketllm: error: cannot listen on {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn and asyncio do
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"pocketllm: error: port {port} on {host} is in use") from None
        raise SystemExit(f"pocketllm: error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def http_url(sock: socket.socket, host: str) -> str:
    """``http://HOST:PORT`` of a listening socket (the port it got, when 0 was asked)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def add_exposure_flags(parser: argparse.ArgumentParser, hosts_help: str, origins_help: str) -> None:
    """``--allowed-hosts`` and ``--allowed-origins`` (comma-separated, repeatable; '*': any), each help text
    saying what the command answers besides its loopback names and its own origin."""
    parser.add_argument("--allowed-hosts", action="append", default=None, metavar="NAMES",
                        help=f"{hosts_help} (comma-separated, repeatable; '*': any).")
    parser.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                        help=f"{origins_help} (comma-separated, repeatable; '*': any).")
