"""The load generator's stream reader against a raw server: chunked coding and events cut at any byte."""

from __future__ import annotations

import asyncio

import pytest

from pocketllm.bench import sse_client


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece = body[at:at + size]
        if piece:
            out += b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n"
        at += size
    if at < len(body):
        out += b"%x\r\n" % (len(body) - at) + body[at:] + b"\r\n"
    return out + b"0\r\n\r\n"


async def _serve_once(response: bytes, cut: int) -> tuple[list[bytes], bytes]:
    """Serve ``response`` in pieces of ``cut`` bytes (a pause between them); the events read and the request."""
    request = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request.extend(await reader.readuntil(b"\r\n\r\n"))
        length = int(bytes(request).lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        request.extend(await reader.readexactly(length))
        for at in range(0, len(response), cut):
            writer.write(response[at:at + cut])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        events = [payload async for _, payload in sse_client.stream_events(
            f"http://127.0.0.1:{port}/v1/completions", b'{"a": 1}', {"Authorization": "Bearer k"})]
    finally:
        server.close()
    return events, bytes(request)


@pytest.mark.parametrize("cut", [1, 3, 7, 64, 4096])
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"])
def test_events_survive_any_cut_of_a_chunked_stream(cut, line_end):
    events = [b'{"x": %d}' % i for i in range(5)] + [b"[DONE]"]
    body = b"".join(b": comment" + line_end + b"data: " + e + line_end + line_end for e in events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, request = asyncio.run(_serve_once(head + _chunked(body, [5, 1, 17, 2, 40]), cut))
    assert got == events
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in request
    assert request.endswith(b'\r\n\r\n{"a": 1}')


def test_a_body_with_a_length_and_a_refusal():
    body = b"data: one\n\ndata: two\ndata: lines\n\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    assert asyncio.run(_serve_once(head + body, 5))[0] == [b"one", b"two\nlines"]
    refusal = b'{"error": {"message": "bad"}}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(refusal)
    with pytest.raises(sse_client.HTTPStatusError, match="HTTP 400: b'{\"error\"") as caught:
        asyncio.run(_serve_once(head + refusal, 4))
    assert caught.value.status == 400


def test_a_stream_cut_short_is_an_error():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(ConnectionError, match="closed inside the response body"):
        asyncio.run(_serve_once(head + b"a\r\ndata: x\n\n", 100))
