"""``bench serve``'s sending side: requests sent on their schedule and timed, in this process or spread over
worker processes (each with its own event loop), so that reading the streams never becomes the bottleneck.

Times are ``time.monotonic()`` readings, one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import time
from typing import Any

from pocketllm.bench import sse_client

Scheduled = list[tuple[float, dict[str, Any]]]   # (seconds after the start, request body)


def carries_tokens(choice: dict[str, Any]) -> bool:
    """A streamed choice that brings generated tokens: text, or (a server without a tokenizer streams an empty
    text for each token) any chunk before the last. The last one may bring tokens too, which only the usage
    can tell: see ``_token_arrivals``."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def _token_arrivals(chunks: list[float], finished_at: float | None, output_tokens: int | None) -> list[float]:
    """When the stream's tokens arrived. A server that fell behind joins a request's tokens into fewer chunks,
    all of them into the finishing one at worst; without a tokenizer that chunk's text is empty, so when no
    other chunk brought tokens but the usage counts some, they came with the finishing chunk."""
    if not chunks and finished_at is not None and output_tokens:
        return [finished_at]
    return chunks


async def _one(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
    """One streamed request: when it started and ended, when each chunk with tokens arrived, its token counts
    and its error (None when it completed)."""
    start = time.monotonic()
    chunks: list[float] = []
    error = None
    output_tokens = None
    finished_at = None

    async def read() -> None:
        nonlocal error, output_tokens, finished_at
        async for arrived, payload in sse_client.stream_events(url, json.dumps(body).encode(), headers):
            if payload == b"[DONE]":
                continue
            data = json.loads(payload)
            if "error" in data:
                error = data["error"].get("message", "error")
                continue
            choices = data.get("choices", [])
            if any(carries_tokens(c) for c in choices):
                chunks.append(arrived)
            if any(c.get("finish_reason") is not None for c in choices):
                finished_at = arrived
            if data.get("usage"):
                output_tokens = data["usage"]["completion_tokens"]

    try:
        await asyncio.wait_for(read(), timeout)
        chunks = _token_arrivals(chunks, finished_at, output_tokens)
        if error is None and not chunks:
            error = "the stream carried no tokens"
    except sse_client.HTTPStatusError as exc:
        error = str(exc)
    except Exception as exc:  # counted as a failed request
        error = repr(exc)
    return {"start": start, "end": time.monotonic(), "chunks": chunks, "error": error,
            "output_tokens": body["max_tokens"] if output_tokens is None else output_tokens,
            "prompt_tokens": len(body["prompt"])}


async def _send(url: str, scheduled: Scheduled, headers: dict[str, str], timeout: float, concurrency: int,
                start_at: float) -> list[dict[str, Any]]:
    semaphore = asyncio.Semaphore(max(1, concurrency))

    async def limited(body: dict[str, Any]) -> dict[str, Any]:
        async with semaphore:
            return await _one(url, body, headers, timeout)

    tasks = []
    for offset, body in scheduled:
        delay = start_at + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(limited(body)))
    return list(await asyncio.gather(*tasks))


def _worker(conn: Any, url: str, scheduled: Scheduled, headers: dict[str, str], timeout: float,
            concurrency: int) -> None:
    """A worker process: say ready, take the common start time, send its shard, return the results."""
    conn.send("ready")
    start_at = conn.recv()
    conn.send(asyncio.run(_send(url, scheduled, headers, timeout, concurrency, start_at)))
    conn.close()


def send_all(url: str, scheduled: Scheduled, headers: dict[str, str], timeout: float, max_concurrency: int | None,
             processes: int) -> tuple[list[dict[str, Any]], float]:
    """Send every request on its schedule; the results in the schedule's order and the start time. With more
    than one process, request i goes to process i mod N and each process allows its share of
    ``max_concurrency`` in flight."""
    processes = max(1, min(processes, len(scheduled)))
    if processes == 1:
        start_at = time.monotonic()
        return asyncio.run(_send(url, scheduled, headers, timeout, max_concurrency or len(scheduled), start_at)), \
            start_at
    context = multiprocessing.get_context("spawn")
    workers = []
    for index in range(processes):
        shard = scheduled[index::processes]
        share = math.ceil(max_concurrency / processes) if max_concurrency else len(shard)
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, url, shard, headers, timeout, share), daemon=True)
        process.start()
        child.close()
        workers.append((parent, process))
    try:
        for parent, _ in workers:
            if parent.recv() != "ready":
                raise RuntimeError("a load-generator process failed to start")
        start_at = time.monotonic() + 0.05
        for parent, _ in workers:
            parent.send(start_at)
        shards = [parent.recv() for parent, _ in workers]
    except EOFError as exc:
        raise RuntimeError("a load-generator process exited early") from exc
    finally:
        for parent, process in workers:
            parent.close()
            process.join(10)
    results: list[dict[str, Any]] = [{}] * len(scheduled)
    for index, shard in enumerate(shards):
        results[index::processes] = shard
    return results, start_at
