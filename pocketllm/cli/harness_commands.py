"""``pocketllm pipe``, ``pocketllm host`` and ``pocketllm connect``: the resident-model harness."""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from pocketllm.cli.exits import usage_error
from pocketllm.cli.launched_ranks import launched_rank
from pocketllm.cli.listen import add_exposure_flags, http_url, listen_socket
from pocketllm.config import EngineArgs, parse_field
from pocketllm.harness.lifecycle import LOOPBACK, display_name, say

TOKEN_ENV = "POCKETLLM_TOKEN"


def _engine_flags(parser: argparse.ArgumentParser, max_seqs: int) -> None:
    parser.add_argument("-m", "--model", default=None,
                        help="A .gguf file or an HF safetensors directory (default: the packaged SmolLM2-135M).")
    parser.add_argument("--ctx", type=int, default=None,
                        help="Context length in tokens, prompt plus answer (default: the checkpoint's context, "
                             "capped by the KV cache).")
    parser.add_argument("--max-seqs", type=int, default=max_seqs,
                        help=f"Most requests decoding at once (default: {max_seqs}); more wait their turn.")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda (default: auto).")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="Shard the model over N ranks (default: 1).")
    parser.add_argument("--tensor-parallel-supervisor", action=argparse.BooleanOptionalAction, default=None,
                        help="Start the ranks here (the default); off: an external launcher (torchrun) started "
                             "them, rank 0 runs the command and the others serve its steps.")
    parser.add_argument("--verbose", action="store_true", help="Log scheduling and harness records at DEBUG.")


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    """The harness flags over ``POCKETLLM_*`` settings (the other engine options come from there)."""
    given = {"max_num_seqs": args.max_seqs}
    if args.ctx is not None:
        given["max_model_len"] = args.ctx
    if args.model is not None:
        given["model"] = args.model
    if args.device is not None:
        given["device"] = parse_field("device", args.device)
    for name in ("tensor_parallel_size", "tensor_parallel_supervisor"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    return EngineArgs.from_env(**given)


def add_harness_parsers(subparsers) -> None:
    pipe = subparsers.add_parser(
        "pipe", help="Serve JSONL requests on stdin, answers on stdout (several conversations, one model).")
    _engine_flags(pipe, max_seqs=4)
    pipe.set_defaults(handler=pipe_command)

    host = subparsers.add_parser("host", help="Serve WebSocket clients and the web client on 127.0.0.1.")
    _engine_flags(host, max_seqs=4)
    host.add_argument("--port", type=int, default=8850, help="Port on 127.0.0.1 (default: 8850; 0 picks one).")
    host.add_argument("--token", default=None,
                      help=f"Shared secret every connection presents (default: ${TOKEN_ENV}, else a random one "
                           "printed on stderr).")
    host.add_argument("--max-conns", type=int, default=16, help="Most connections at once (default: 16).")
    host.add_argument("--idle-expiry", type=int, default=600_000, metavar="MS",
                      help="Forget a session idle this long, in ms (default: 600000; 0 never).")
    host.add_argument("--kv-store", default=None, metavar="DIR",
                      help="Keep sessions' conversations and KV blocks here so reconnects, also after a restart, "
                           "resume warm.")
    host.add_argument("--web", default=None, metavar="DIR",
                      help="Serve this directory as the web client instead of the built-in one.")
    add_exposure_flags(host, "Host header names answered besides loopback ones, e.g. a tunnel's name",
                       "Web origins whose pages may open a WebSocket besides the host's own")
    host.set_defaults(handler=host_command)

    connect = subparsers.add_parser("connect", help="Hold a conversation in the terminal with a running host.")
    connect.add_argument("address", metavar="[HOST:]PORT", help="The host's port (host defaults to 127.0.0.1).")
    connect.add_argument("--token", default=None, help=f"The host's token (default: ${TOKEN_ENV}).")
    connect.add_argument("--session", default=None, help="Resume this session (or start one with this name).")
    connect.add_argument("--verbose", action="store_true", help="Log at DEBUG.")
    connect.set_defaults(handler=connect_command)


def _positive(command: str, name: str, value: int | None) -> None:
    if value is not None and value < 1:
        usage_error(command, f"{name} must be positive, got {value}")


def pipe_command(args: argparse.Namespace) -> int:
    _positive("pipe", "--ctx", args.ctx)
    _positive("pipe", "--max-seqs", args.max_seqs)
    engine_args = _engine_args(args)
    if (status := launched_rank(engine_args)) is not None:
        return status
    from pocketllm.harness.pipe import run_pipe

    return run_pipe(engine_args)


def host_command(args: argparse.Namespace) -> int:
    for name in ("ctx", "max_seqs", "max_conns"):
        _positive("host", "--" + name.replace("_", "-"), getattr(args, name))
    if not 0 <= args.port < 65536:
        usage_error("host", f"--port {args.port} is out of range")
    if args.idle_expiry < 0:
        usage_error("host", "--idle-expiry must be >= 0")
    if args.web is not None and not os.path.isfile(os.path.join(args.web, "index.html")):
        usage_error("host", f"--web {args.web} has no index.html")
    engine_args = _engine_args(args)
    if (status := launched_rank(engine_args)) is not None:   # rank 0 alone listens
        return status
    token = args.token or os.environ.get(TOKEN_ENV)
    generated = not token
    if generated:
        token = secrets.token_urlsafe(18)
    sock = listen_socket(LOOPBACK, args.port)   # before anything slow: a busy port is one line, at once
    say(f"listening on {http_url(sock, LOOPBACK)}/#token={token}")
    if generated:
        say(f"(a new token each start; choose one with --token or ${TOKEN_ENV})")
    say(f"loading {display_name(engine_args.model)}")
    from pocketllm.harness.host import HostConfig, run_host

    config = HostConfig(engine_args=engine_args, port=sock.getsockname()[1], token=token, max_conns=args.max_conns,
                        idle_expiry_ms=args.idle_expiry, kv_store=args.kv_store, web_dir=args.web, sock=sock,
                        allowed_hosts=tuple(args.allowed_hosts or ()),
                        allowed_origins=tuple(args.allowed_origins or ()))
    return run_host(config)


def connect_command(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        usage_error("connect", f"pass --token or set ${TOKEN_ENV}")
    from websockets.exceptions import WebSocketException

    from pocketllm.harness.client import run_connect

    try:
        return run_connect(args.address, token, args.session)
    except (OSError, WebSocketException) as exc:
        print(f"pocketllm: connection to {args.address} failed or was closed: {exc}", file=sys.stderr)
        return 1
