"""``pocketllm serve``: the OpenAI-compatible server, with a graceful drain on SIGTERM/SIGINT.

The port is bound first (a busy one is one line and an exit at once), ``listening on …`` is printed, then the
model loads behind the open listener (``/ready`` answers 503 until ``ready: …`` is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading

from pocketllm.cli.engine_flags import add_engine_flags, engine_args_from
from pocketllm.cli.exits import usage_error
from pocketllm.cli.launched_ranks import launched_rank
from pocketllm.cli.listen import add_exposure_flags, http_url, listen_socket
from pocketllm.harness.lifecycle import INTERRUPTED, display_name, say

logger = logging.getLogger("pocketllm.server")


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", usage="%(prog)s [options] [MODEL]",
                                   help="Serve the model over an OpenAI-compatible HTTP API.")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="A .gguf file or an HF safetensors directory (the same as --model).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    parser.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/*.")
    parser.add_argument("--served-model-name", default=None, help="Model name reported and echoed back.")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="Seconds a request may take before its unfinished choices are cancelled.")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, seconds in-flight requests may finish before being cancelled.")
    parser.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                        help="Refuse request bodies larger than N bytes with a 413 (default: 8 MiB).")
    add_exposure_flags(parser, "Host header names answered besides loopback ones; bound to loopback without "
                               "--api-key, other names are refused",
                       "Browser origins (e.g. http://localhost:3000) allowed besides the server's own")
    parser.add_argument("--access-log", action="store_true", help="Log one line per request on stderr.")
    parser.add_argument("--verbose", action="store_true", help="Log scheduling decisions at DEBUG.")
    add_engine_flags(parser)
    parser.set_defaults(handler=serve_command)


def _tensor_parallel_role(args: argparse.Namespace, engine_args) -> int | None:
    """With tensor_parallel_size > 1: supervise the ranks (the default) or, as a rank a supervisor or launcher
    started, run a worker (rank > 0); the exit status, or None when this process is rank 0 and serves."""
    if engine_args.tensor_parallel_size > 1 and engine_args.tensor_parallel_supervisor:
        from pocketllm.distributed.supervisor import supervise

        listen_socket(args.host, args.port).close()   # a busy port fails here, before any rank starts
        rerun = getattr(args, "argv", sys.argv[1:])
        argv = [sys.executable, "-m", "pocketllm", *rerun, "--no-tensor-parallel-supervisor"]
        return supervise(argv, engine_args)
    return launched_rank(engine_args)


def _access_log() -> None:
    """The "pocketllm.access" logger's lines on stderr: a time and the request."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    access = logging.getLogger("pocketllm.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def serve_command(args: argparse.Namespace) -> int:
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            usage_error("serve", "give the model once: as MODEL or as --model")
        args.model = args.model_positional
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        usage_error("serve", "--max-request-bytes must be a positive number of bytes")
    engine_args = engine_args_from(args)
    status = _tensor_parallel_role(args, engine_args)
    if status is not None:
        return status
    sock = listen_socket(args.host, args.port)
    say(f"listening on {http_url(sock, args.host)}")
    name = args.served_model_name or display_name(engine_args.model)
    say(f"loading {name}")
    if args.access_log:
        _access_log()
    import uvicorn

    from pocketllm.backends.engine_proc import freeze_startup_heap
    from pocketllm.server.app import ServerConfig, ServerState, build_app
    from pocketllm.server.exposure import ExposurePolicy
    from pocketllm.server.guards import DEFAULT_MAX_REQUEST_BYTES
    from pocketllm.server.http_protocol import uvicorn_config

    failed = threading.Event()

    def on_loaded(state: ServerState) -> None:
        if state.draining:
            return
        if state.load_error is None:
            freeze_startup_heap()
            say(f"ready: {name} (load {state.load_seconds:.1f} s)")
        else:   # a server without its model is of no use: stop it
            say(f"pocketllm: error: the model failed to load: {state.load_error}")
            failed.set()
            server.should_exit = True

    exposure = ExposurePolicy.build(args.host, allowed_hosts=args.allowed_hosts or (),
                                    allowed_origins=args.allowed_origins or (), check_hosts=args.api_key is None)
    config = ServerConfig(engine_args=engine_args, served_model_name=args.served_model_name,
                          api_key=args.api_key, request_timeout=args.request_timeout,
                          access_log=args.access_log, on_loaded=on_loaded, exposure=exposure,
                          max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    app = build_app(config)
    state = app.state.pocketllm
    shutdown_timeout = args.shutdown_timeout

    class DrainingServer(uvicorn.Server):
        """Stops accepting at the first signal; cancels what is still running after the shutdown timeout."""

        interrupted = False

        def handle_exit(self, sig, frame) -> None:
            if not state.draining:
                state.draining = True
                self.interrupted = sig == signal.SIGINT
                if state.serving is not None and not failed.is_set():
                    say(f"shutting down: draining in-flight requests for up to {shutdown_timeout:.0f} s")
                timer = threading.Timer(shutdown_timeout, lambda: state.serving and state.serving.cancel_all())
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown; the exit status says what happened instead.
            self._captured_signals.clear()

    server = DrainingServer(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout + 10))
    server.run(sockets=[sock])
    if state.llm is not None:
        asyncio.run(state.llm.shutdown())
    if server.interrupted:
        return INTERRUPTED
    return 1 if failed.is_set() else 0
