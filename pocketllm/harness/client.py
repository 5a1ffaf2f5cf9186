"""``pocketllm connect``: a terminal conversation with a running host (one session; ``--session`` resumes)."""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.harness.line_input import read_line


def parse_address(address: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` → (host, port); the host defaults to 127.0.0.1."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise InvalidRequestError(f"cannot read {address!r} as [HOST:]PORT", param="address") from None
    if not 0 < number < 65536:
        raise InvalidRequestError(f"port {number} is out of range", param="address")
    return host, number


class HostClient:
    """A blocking connection to a host: auth, then request/response by id."""

    def __init__(self, address: str, token: str) -> None:
        from websockets.sync.client import connect

        host, port = parse_address(address)
        # (entered by hand: the connection lives as long as this object; ``close`` ends it)
        self.ws = connect(f"ws://{host}:{port}/", max_size=8 << 20, open_timeout=10,
                          compression=None).__enter__()
        self.notices: list[dict[str, Any]] = []
        reply = self.request({"op": "auth", "id": "auth", "token": token}, "auth")
        if reply.get("auth") != "ok":
            raise InvalidRequestError(f"the host refused the connection: {reply.get('error', reply)}")

    def send(self, obj: dict[str, Any]) -> None:
        self.ws.send(json.dumps(obj, ensure_ascii=False))

    def recv(self) -> dict[str, Any]:
        return json.loads(self.ws.recv())

    def request(self, obj: dict[str, Any], request_id: Any) -> dict[str, Any]:
        """Send ``obj`` and return the first answer carrying ``request_id`` (other lines are kept as notices)."""
        from websockets.exceptions import ConnectionClosed

        try:
            self.send(obj)
        except ConnectionClosed:
            pass   # what the host said before closing is still read below
        while True:
            try:
                reply = self.recv()
            except ConnectionClosed:
                said = "; ".join(n["error"] for n in self.notices if "error" in n)
                raise InvalidRequestError(f"the host closed the connection{': ' + said if said else ''}") from None
            if reply.get("id") == request_id:
                return reply
            self.notices.append(reply)

    def close(self) -> None:
        self.ws.close()


def _print_history(messages: list[dict[str, str]]) -> None:
    for message in messages:
        if message["role"] == "system":
            continue
        prefix = "> " if message["role"] == "user" else ""
        print(f"{prefix}{message['content']}")


def _turn(client: HostClient, request_id: int, session: str, text: str) -> None:
    client.send({"op": "chat", "id": request_id, "session": session,
                 "messages": [{"role": "user", "content": text}]})
    cancelled = False
    while True:
        try:
            reply = client.recv()
        except KeyboardInterrupt:   # the first Ctrl-C stops the answer, a second one leaves
            if cancelled:
                raise
            client.send({"op": "cancel", "id": request_id})
            cancelled = True
            continue
        if reply.get("id") != request_id:
            client.notices.append(reply)
            continue
        if "chunk" in reply:
            sys.stdout.write(reply["chunk"])
            sys.stdout.flush()
        elif reply.get("done"):
            usage = reply.get("usage", {})
            print()
            print(f"[{usage.get('gen_tokens')} tokens, finish {reply.get('finish')}; prompt "
                  f"{usage.get('prompt_tokens')} tokens, prefill {usage.get('prefill_ms')} ms, decode "
                  f"{usage.get('decode_ms')} ms]", file=sys.stderr)
            return
        elif "error" in reply:
            print(f"error: {reply['error']}", file=sys.stderr)
            return


def run_connect(address: str, token: str, session: str | None) -> int:
    client = HostClient(address, token)
    try:
        opening: dict[str, Any] = {"op": "open", "id": "open"}
        if session:
            opening["session"] = session
        reply = client.request(opening, "open")
        if "error" in reply:
            print(f"error: {reply['error']}", file=sys.stderr)
            return 2
        sid = reply["session"]
        if reply.get("resumed"):
            print(f"[resumed session {sid}]", file=sys.stderr)
            _print_history(reply.get("messages") or [])
        elif session:
            print(f"[the host had no session {sid}; starting it fresh]", file=sys.stderr)
        print(f"[session {sid}: resume it with --session {sid}; /exit to leave, Ctrl-C stops an answer]",
              file=sys.stderr)
        ids = itertools.count(1)
        while True:
            for notice in client.notices:
                if notice.get("expired") or notice.get("detached"):
                    print(f"[session {sid}: {notice.get('detached') or 'expired'}; reopening]", file=sys.stderr)
                    client.request({"op": "open", "id": "open", "session": sid}, "open")
                elif "error" in notice:
                    print(f"error: {notice['error']}", file=sys.stderr)
            client.notices.clear()
            line = read_line()
            if line is None:
                return 0
            if line.strip():
                _turn(client, next(ids), sid, line)
    finally:
        client.close()
