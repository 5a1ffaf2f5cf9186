"""``pocketllm serve``: the OpenAI-compatible server, with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

from pocketllm.cli.engine_flags import add_engine_flags, engine_args_from

logger = logging.getLogger("pocketllm.server")


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="Serve the model over an OpenAI-compatible HTTP API.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    parser.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/*.")
    parser.add_argument("--served-model-name", default=None, help="Model name reported and echoed back.")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="Seconds a request may take before its unfinished choices are cancelled.")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, seconds in-flight requests may finish before being cancelled.")
    parser.add_argument("--verbose", action="store_true", help="Log scheduling decisions at DEBUG.")
    add_engine_flags(parser)
    parser.set_defaults(handler=serve_command)


def _tensor_parallel_role(args: argparse.Namespace, engine_args) -> int | None:
    """With tensor_parallel_size > 1: supervise the ranks (the default) or, as a rank a supervisor or launcher
    started, run a worker (rank > 0); the exit status, or None when this process is rank 0 and serves."""
    if engine_args.tensor_parallel_size == 1:
        return None
    if engine_args.tensor_parallel_supervisor:
        from pocketllm.distributed.supervisor import supervise

        rerun = getattr(args, "argv", sys.argv[1:])
        argv = [sys.executable, "-m", "pocketllm", *rerun, "--no-tensor-parallel-supervisor"]
        return supervise(argv, engine_args)
    from pocketllm.distributed.group import RankInfo

    if RankInfo.from_env(os.environ, engine_args.tensor_parallel_size).rank == 0:
        return None
    from pocketllm.backends.tp_worker import run_worker

    return run_worker(engine_args)


def serve_command(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args)
    status = _tensor_parallel_role(args, engine_args)
    if status is not None:
        return status
    import uvicorn

    from pocketllm.server.app import ServerConfig, build_app

    config = ServerConfig(engine_args=engine_args, served_model_name=args.served_model_name,
                          api_key=args.api_key, request_timeout=args.request_timeout)
    app = build_app(config)
    state = app.state.pocketllm
    shutdown_timeout = args.shutdown_timeout

    class DrainingServer(uvicorn.Server):
        """Stops accepting at the first signal; cancels what is still running after the shutdown timeout."""

        def handle_exit(self, sig, frame) -> None:
            if not state.draining:
                state.draining = True
                logger.warning("shutting down: draining in-flight requests for up to %.0f s", shutdown_timeout)
                timer = threading.Timer(shutdown_timeout, lambda: state.serving and state.serving.cancel_all())
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown; a drained server exits 0 instead.
            self._captured_signals.clear()

    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=shutdown_timeout + 10))
    server.run()
    if state.llm is not None:
        asyncio.run(state.llm.shutdown())
    return 0
