"""A bounded HTTP fuzzer over the endpoints of the real app and engine (a tiny random checkpoint): no
generated body gets a 5xx, every error is in the OpenAI shape, and a stream carries no error event; and raw,
malformed HTTP/1.1 requests sent to the same app behind uvicorn with the server's own protocol are answered in
the OpenAI shape too (or, cut short, closed without an answer), never in uvicorn's plain text.

``POCKETLLM_FUZZ_CASES`` sets the number of body cases (default 2,000; ``make soak`` runs 20,000); a tenth as
many raw requests are sent."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from http_fuzz import MALFORMED_HTTP, fuzz_cases, raw_http_requests

from pocketllm.protocol.openai_fields import RESPONSES

CASES = int(os.environ.get("POCKETLLM_FUZZ_CASES", "2000"))


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app

    args = EngineArgs(model=tiny_checkpoint("llama"), max_model_len=256, cpu_kv_cache_gb=0.05)
    client = TestClient(build_app(ServerConfig(args, served_model_name="tiny")), raise_server_exceptions=False)
    client.__enter__()
    deadline = time.monotonic() + 120
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.02)
    yield client
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """The port of the app with a tiny engine behind uvicorn, configured as ``pocketllm serve`` does."""
    import threading

    import httpx
    import uvicorn

    from pocketllm.cli.listen import listen_socket
    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app
    from pocketllm.server.http_protocol import uvicorn_config

    args = EngineArgs(model=tiny_checkpoint("llama"), max_model_len=256, cpu_kv_cache_gb=0.05)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(build_app(ServerConfig(args, served_model_name="tiny")),
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not become ready"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(60)
    sock.close()


def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` raw, close the sending side, and read until the server closes the connection."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except OSError:   # the server answered and closed before it had read everything
            pass
        reply = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            reply += data
    return reply


def _replies(data: bytes) -> list[tuple[int, bytes]] | str:
    """The (status, body) of each response in ``data`` (a connection may answer several pipelined requests),
    or what makes ``data`` unreadable."""
    replies = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ")
        if not sep or len(status_line) < 2 or not status_line[1].isdigit():
            return f"not an HTTP reply: {data[:200]!r}"
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:] if b": " in line)
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body, rest = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
        else:
            length = int(headers.get(b"content-length", b"0"))
            body, rest = rest[:length], rest[length:]
        replies.append((int(status_line[1]), body))
        data = rest
    return replies


def _raw_problem(reply: bytes) -> str | None:
    """What is wrong with a raw reply, or None: no reply (a request cut short) or responses with statuses
    below 500 whose errors are JSON in the OpenAI shape."""
    replies = _replies(reply)
    if isinstance(replies, str):
        return replies
    for status, body in replies:
        if status >= 500:
            return f"{status}: {body[:200]!r}"
        if status >= 400:
            try:
                error = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                return f"{status} not in the OpenAI shape: {reply[:300]!r}"
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                return f"{status} not in the OpenAI shape: {error}"
    return None


def test_malformed_http_is_answered_in_the_openai_shape(served):
    """Each known malformed request gets a 400 in the OpenAI shape (uvicorn's own answer is plain text)."""
    for request in MALFORMED_HTTP:
        reply = _exchange(served, request)
        assert reply.startswith(b"HTTP/1.1 4"), (request[:80], reply[:300])
        assert _raw_problem(reply) is None, (request[:80], _raw_problem(reply))
    malformed = _exchange(served, MALFORMED_HTTP[0])
    assert b"content-type: application/json" in malformed.lower() and malformed.startswith(b"HTTP/1.1 400")


def test_mutated_raw_requests_get_no_5xx_and_no_bare_error(served):
    import httpx

    requests = raw_http_requests(max(CASES // 10, len(MALFORMED_HTTP) + 50), random.Random(26))
    statuses: dict[int, int] = {}
    problems = []
    for request in requests:
        reply = _exchange(served, request)
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
        statuses[status] = statuses.get(status, 0) + 1
        problem = _raw_problem(reply)
        if problem is not None:
            problems.append(f"{request[:120]!r}: {problem}")
    assert not problems, f"{len(problems)} of {len(requests)} requests: " + "\n".join(problems[:10])
    assert statuses.get(400, 0) > len(requests) // 10 and statuses.get(200, 0) > 0, statuses   # both kinds ran
    assert httpx.get(f"http://127.0.0.1:{served}/health", timeout=30).json()["status"] == "ok"


def _responses_problem(response) -> str | None:
    """What is wrong with one /v1/responses answer, or None: a stream must end with the whole response and
    carry no error event; a whole response has a status and output."""
    if response.status_code >= 400 or not response.headers.get("content-type", "").startswith("text/event-stream"):
        if response.status_code == 200 and response.json().get("status") not in ("completed", "incomplete"):
            return f"a 200 without a finished response: {response.text[:300]}"
        return _problem(response, chat_shaped=False)
    events = [json.loads(line[len("data: "):]) for line in response.text.split("\n") if line.startswith("data: ")]
    if not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
        return f"a stream without its last response event: {response.text[-300:]}"
    if [e["sequence_number"] for e in events] != list(range(len(events))):
        return "sequence numbers out of order"
    if any(e["type"] == "error" for e in events):
        return f"an error event in a stream: {response.text[-300:]}"
    return None


def _problem(response, chat_shaped: bool = True) -> str | None:
    """What is wrong with one answer, or None."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} not in the OpenAI shape: {response.text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"{response.status_code} not in the OpenAI shape: {error}"
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            return f"a stream without [DONE]: {response.text[-300:]}"
        for line in lines[:-1]:
            if "error" in json.loads(line[len("data: "):]):
                return f"an error event in a stream: {line[:300]}"
    elif chat_shaped:
        body = response.json()
        if not body.get("choices"):
            return f"a 200 without choices: {response.text[:300]}"
    return None


def _rss_mib() -> float:
    """This process's resident memory (the app and its engine run in it)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith("VmRSS:"))


def test_no_generated_body_gets_a_5xx_or_a_bare_error(client):
    """... and the process's resident memory after the run is within 10% of what it was after a warm-up
    (the first tenth of the cases)."""
    statuses: dict[int, int] = {}
    problems: list[str] = []
    warmup = CASES // 10
    for index, (path, body) in enumerate(fuzz_cases(CASES, random.Random(31))):
        if index == warmup:
            before = _rss_mib()
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = _problem(response)
        if problem is not None:
            problems.append(f"{path} {body[:200]!r}: {problem}")
    assert not problems, f"{len(problems)} of {CASES} cases: " + "\n".join(problems[:10])
    assert statuses.get(200, 0) > CASES // 20 and statuses.get(400, 0) > CASES // 2, statuses   # both kinds ran
    assert client.get("/health").json()["status"] == "ok"
    after = _rss_mib()
    assert after <= 1.10 * before, f"RSS grew from {before:.0f} MiB to {after:.0f} MiB over the fuzz run"


def test_no_generated_responses_body_gets_a_5xx_or_a_bare_error(client):
    statuses: dict[int, int] = {}
    problems: list[str] = []
    count = max(CASES // 4, 200)
    for path, body in fuzz_cases(count, random.Random(37), endpoints=(RESPONSES,)):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = _responses_problem(response)
        if problem is not None:
            problems.append(f"{path} {body[:200]!r}: {problem}")
    assert not problems, f"{len(problems)} of {count} cases: " + "\n".join(problems[:10])
    assert statuses.get(200, 0) > count // 20 and statuses.get(400, 0) > count // 2, statuses   # both kinds ran
