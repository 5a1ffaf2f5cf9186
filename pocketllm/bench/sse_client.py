"""A lean HTTP/1.1 client for one streamed POST: the server-sent events' data payloads as they arrive.

``bench serve`` reads tens of thousands of events a second from one Python process; a general client's work per
event (httpx's line iterator: about 140 µs of client CPU an event with parsing, measured) made the load generator
the bottleneck it was meant to measure. Here a read takes whatever bytes have arrived, and the chunked transfer
coding and the event framing are cut out of one buffer, so an event costs a few slices.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


class HTTPStatusError(Exception):
    """The server answered with a status other than 200: ``status`` and the start of the body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body


def _request_bytes(host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             "Accept: text/event-stream", f"Content-Length: {len(body)}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and lower-cased headers of a response head (without its blank line)."""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class _Body:
    """A response body's bytes as they arrive, with the chunked transfer coding taken off."""

    def __init__(self, reader: asyncio.StreamReader, buffered: bytes, headers: dict[str, str]) -> None:
        self.reader = reader
        self.raw = bytearray(buffered)
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.remaining = int(length) if length is not None and not self.chunked else None
        self.done = False
        self.pending = 0   # bytes of the current chunk still to come (chunked only)

    async def _more(self) -> bool:
        data = await self.reader.read(READ_SIZE)
        if not data:
            return False
        self.raw += data
        return True

    def _take_chunks(self) -> bytes:
        """Decoded bytes available in ``raw`` now (chunked coding)."""
        out = bytearray()
        raw = self.raw
        while raw:
            if self.pending > 0:
                take = min(self.pending, len(raw))
                out += raw[:take]
                del raw[:take]
                self.pending -= take
                if self.pending == 0:
                    self.pending = -2   # the chunk's CRLF follows
                continue
            if self.pending < 0:
                if len(raw) < -self.pending:
                    break
                del raw[:-self.pending]
                self.pending = 0
                continue
            end = raw.find(b"\r\n")
            if end < 0:
                break
            size = int(bytes(raw[:end]).split(b";", 1)[0], 16)
            del raw[:end + 2]
            if size == 0:
                self.done = True
                break
            self.pending = size
        return bytes(out)

    async def pieces(self) -> AsyncIterator[tuple[float, bytes]]:
        """(arrival time, decoded bytes) for each read, until the body ends."""
        first = True
        while not self.done:
            if not first and not await self._more():
                if self.chunked or (self.remaining or 0) > 0:
                    raise ConnectionError("the connection closed inside the response body")
                return
            first = False
            now = time.monotonic()
            if self.chunked:
                data = self._take_chunks()
            else:
                data = bytes(self.raw)
                self.raw.clear()
                if self.remaining is not None:
                    data = data[:self.remaining]
                    self.remaining -= len(data)
                    self.done = self.remaining <= 0
            if data:
                yield now, data

    async def read_all(self) -> bytes:
        return b"".join([data async for _, data in self.pieces()])


async def stream_events(url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[tuple[float, bytes]]:
    """POST ``body`` (JSON) to ``url`` and yield (arrival time, data payload) for each server-sent event, until
    the response ends; ``HTTPStatusError`` if the status is not 200."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port,
                                                   ssl=ssl.create_default_context() if secure else None,
                                                   limit=READ_SIZE * 4)
    try:
        writer.write(_request_bytes(parts.netloc, parts.path or "/", body, headers))
        raw = b""
        while b"\r\n\r\n" not in raw:
            data = await reader.read(READ_SIZE)
            if not data:
                raise ConnectionError("the server closed the connection before answering")
            raw += data
        head, _, rest = raw.partition(b"\r\n\r\n")
        status, response_headers = _parse_head(head)
        response = _Body(reader, rest, response_headers)
        if status != 200:
            raise HTTPStatusError(status, await response.read_all())
        pending = b""
        async for arrived, data in response.pieces():
            pending += data
            if b"\r" in pending:   # CRLF line ends (a CR at the end waits for its LF)
                pending = pending.replace(b"\r\n", b"\n")
            *events, pending = pending.split(b"\n\n")
            for event in events:
                lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
                if lines:
                    yield arrived, b"\n".join(lines)
    finally:
        writer.close()
