"""Generated HTTP request bodies for the server's fuzz test: valid requests bent one to three ways (a field of
the policy table set to a hostile value, an unknown field, broken messages or prompts), and raw bodies that are
not JSON objects at all. Values stay small enough that an accepted request generates at most a few tokens."""

from __future__ import annotations

import json
import random
from typing import Any

from pocketllm.protocol.openai_fields import CHAT, COMPLETIONS, FIELD_POLICY, RESPONSES

LONE = "\ud800"
DEEP = 200
HOSTILE: list[Any] = [
    None, True, False, 0, 1, 3, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**400, 0.5, -0.0, 1e308, -1e308,
    float("nan"), float("inf"), "", "x", "٣", " 5", "05", LONE, "a" + LONE, "\x00", "x" * 5000, [], {}, [1, 2],
    [[1]], ["a", 1], {"a": 1}, {"1": 1}, {"٥": 1}, {"99999999999": 5}, {LONE: 1},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}},
    {"type": "json_object"}, {"type": "text"}, {"type": "nope"}, {"include_usage": True}, ["stop"] * 100,
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    [{"type": "function", "function": {"name": LONE}}], "required", "none", "auto",
]
MESSAGES: list[Any] = [
    [], [{}], [{"role": "user"}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": LONE}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "tool", "content": "x"}], [{"role": "assistant", "content": None, "tool_calls": []}],
    [{"role": "user", "content": "x", "name": LONE}], "hi", None, [{"role": "user", "content": "x" * 4000}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
]
BENIGN: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 5, "n": 2, "stream": True,
                          "stop": ["\n", "x"], "frequency_penalty": 0.5, "presence_penalty": 0.5,
                          "logit_bias": {"5": 1}, "ignore_eos": True, "min_p": 0.1, "max_tokens": 1,
                          "repetition_penalty": 1.1, "user": "u"}
INPUTS: list[Any] = [
    "", LONE, [], [{}], [{"role": "user"}], [{"type": "function_call"}], [{"type": "function_call_output"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
    [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": LONE}]}],
    [{"role": "user", "content": [{"type": "input_image"}]}], [{"type": "reasoning", "content": 5}],
    [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}], [{"role": "assistant"}],
    [{"role": "system", "content": "s"}], "x" * 4000, 5, None,
]
RESPONSES_BENIGN: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "stream": True, "instructions": "Be brief.",
                                    "store": False, "metadata": {"k": "v"}, "max_output_tokens": 1,
                                    "text": {"format": {"type": "json_object"}}, "user": "u"}
PROMPTS: list[Any] = [
    "", LONE, [], [[]], [1, 2], [0], [-1], [2**40], [10**30], [1.5], ["a", "b"], [[1], [2]], [[1], "a"], None,
    {"a": 1}, "x" * 4000, [True], [[2**63]],
]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _base(endpoint: str) -> dict[str, Any]:
    if endpoint == RESPONSES:
        return {"model": "x", "input": "hi", "max_output_tokens": 3}
    if endpoint == CHAT:
        return {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {"model": "x", "prompt": "hi", "max_tokens": 3}


def _bent(endpoint: str, rng: random.Random) -> dict[str, Any]:
    body = _base(endpoint)
    fields = list(FIELD_POLICY[endpoint])
    if rng.random() < 0.3:   # requests that should be served
        benign = RESPONSES_BENIGN if endpoint == RESPONSES else BENIGN
        for name in rng.sample(sorted(benign), rng.randint(1, 4)):
            body[name] = benign[name]
        if body.get("stream") and rng.random() < 0.5 and endpoint != RESPONSES:
            body["stream_options"] = {"include_usage": True}
        return body
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if kind <= 2:
            body[rng.choice(fields)] = rng.choice(HOSTILE)
        elif kind == 3:
            body[rng.choice(["nope", LONE, "", "max_tokens ", "Temperature"])] = rng.choice(HOSTILE)
        elif kind == 4:
            if endpoint == RESPONSES:
                body["input"] = rng.choice(INPUTS)
            elif endpoint == CHAT:
                body["messages"] = rng.choice(MESSAGES)
            else:
                body["prompt"] = rng.choice(PROMPTS)
        else:
            body[rng.choice(fields)] = _nested(rng.choice([10, DEEP]))
    # what an accepted request may cost
    for budget in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
        value = body.get(budget)
        if type(value) is int and 3 < value < 2**31:
            body[budget] = 3
    return body


def _raw(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if kind == 1:
        good = json.dumps(_base(CHAT))
        return good[: rng.randrange(1, len(good))].encode()
    if kind == 2:
        return json.dumps(rng.choice([[], 1, "s", None, [{"messages": []}], 1.5])).encode()
    if kind == 3:
        return b"[" * 100_000 + b"]" * 100_000
    if kind == 4:
        return b'{"prompt": "a", "max_tokens": NaN}'
    return b'{"prompt": "\\ud800\\udfff\\udfff", "max_tokens": 1, "prompt": 3}'


PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses"}


def fuzz_cases(count: int, rng: random.Random, endpoints: tuple[str, ...] = (CHAT, COMPLETIONS)
               ) -> list[tuple[str, bytes]]:
    """``count`` (path, body) pairs over ``endpoints``."""
    cases: list[tuple[str, bytes]] = []
    while len(cases) < count:
        endpoint = rng.choice(endpoints)
        path = PATHS[endpoint]
        if rng.random() < 0.15:
            cases.append((path, _raw(rng)))
        else:
            cases.append((path, json.dumps(_bent(endpoint, rng), allow_nan=True).encode()))
    return cases


MALFORMED_HTTP: list[bytes] = [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: \x00\r\nConnection: close\r\n\r\n",
    b"NOT A REQUEST\r\n\r\n",
    b"GET /he\xffalth HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /health HTTP/one\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",   # HTTP/1.1 without a Host
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",   # a TLS hello
    b"GET\x00/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
]
VALID_HTTP: list[bytes] = [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\nConnection: close\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: 30\r\n\r\n{\"prompt\":\"hi\",\"max_tokens\":1}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    # A WebSocket upgrade (the server has no WebSocket route): answered as plain HTTP.
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: bad\r\nSec-WebSocket-Version: 13\r\nConnection: close\r\n\r\n",
]
NOISE = [b"\x00", b"\r", b"\n", b"\xff", b" ", b":", b"\t", b"\x7f", b"%", b"\r\n", b"?", b"/"]


def raw_http_requests(count: int, rng: random.Random) -> list[bytes]:
    """``count`` raw HTTP/1.1 requests: each known malformed one once, then valid requests with one to three
    bytes inserted, replaced or removed (many are then malformed, some still valid)."""
    requests = list(MALFORMED_HTTP)
    while len(requests) < count:
        data = bytearray(rng.choice(VALID_HTTP))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            kind = rng.randrange(3)
            if kind == 0:
                data[at:at] = rng.choice(NOISE)
            elif kind == 1:
                data[at:at + 1] = rng.choice(NOISE)
            else:
                del data[at]
        requests.append(bytes(data))
    return requests[:count]
