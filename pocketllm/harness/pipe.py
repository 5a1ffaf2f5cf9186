"""``pocketllm pipe``: the harness over standard input and output, one JSON object per line each way.

Standard output carries protocol lines only: the process's file descriptor 1 is pointed at standard error
before anything else runs, so a stray print or a native library's message cannot corrupt the stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

from pocketllm.config import EngineArgs
from pocketllm.harness.lifecycle import StopSignals, run_until_done, say
from pocketllm.harness.protocol import LINE_TOO_LONG, MAX_LINE_BYTES, error_line
from pocketllm.harness.service import Channel, Harness

logger = logging.getLogger("pocketllm.harness")


def _protocol_stdout():
    """A private handle on the real stdout; fd 1 and ``sys.stdout`` then point at stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", newline="\n")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _read_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, fd: int = 0) -> None:
    """Reader thread: stdin lines (bytes, without their newline) into the queue, then None at EOF.

    A line that grows past ``MAX_LINE_BYTES`` before its newline comes is not kept: a ``ValueError`` takes its
    place and the rest of it is skipped (one that came whole is refused by ``parse_line``). Reads the raw
    descriptor (not ``sys.stdin``), so a read still blocked at exit holds no interpreter lock.
    """
    def put(item) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    pending = b""
    skipping = False
    try:
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            pending += data
            while True:
                cut = pending.find(b"\n")
                if cut < 0:
                    break
                line, pending = pending[:cut], pending[cut + 1:]
                if skipping:
                    skipping = False
                else:
                    put(line)
            if len(pending) > MAX_LINE_BYTES:
                if not skipping:
                    put(ValueError(LINE_TOO_LONG))
                skipping, pending = True, b""
        if pending and not skipping:
            put(pending)
    except (OSError, RuntimeError) as exc:
        logger.warning("stdin: %s", exc)
    finally:
        try:
            put(None)
        except RuntimeError:  # the loop already ended
            pass


async def serve_pipe(engine_args: EngineArgs, out) -> int:
    loop = asyncio.get_running_loop()
    stop_reading = asyncio.Event()
    harness = Harness(engine_args, on_shutdown=stop_reading.set)
    signals = StopSignals(harness.begin_shutdown)
    signals.install(loop)

    async def write(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    channel = Channel("pipe", write)
    lines: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_lines, args=(loop, lines), name="pocketllm-stdin", daemon=True).start()
    loader = asyncio.create_task(harness.load())
    loader.add_done_callback(lambda task: task.cancelled() or task.exception() is None or stop_reading.set())
    stopping = asyncio.create_task(stop_reading.wait())
    while not stop_reading.is_set():   # after shutdown, nothing more is read
        getter = asyncio.create_task(lines.get())
        finished, _ = await asyncio.wait({getter, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if getter not in finished:
            getter.cancel()
            break
        line = getter.result()
        if line is None:
            break
        if isinstance(line, Exception):
            await channel.send(error_line(str(line)))
        elif line.strip():
            await harness.handle(channel, line)
    stopping.cancel()
    harness.draining = True
    await harness.drain()
    status = 0
    if not loader.done():
        loader.cancel()
    elif loader.exception() is not None:
        say(f"pocketllm: error: the model failed to load: {loader.exception()}")
        await channel.send(error_line(f"the model failed to load: {loader.exception()}"))
        status = 1
    await harness.close()
    return signals.exit_status(status)


def run_pipe(engine_args: EngineArgs) -> int:
    """Serve until end of input, the ``shutdown`` operation, SIGTERM (status 0) or SIGINT (130)."""
    out = _protocol_stdout()
    try:
        return run_until_done(serve_pipe(engine_args, out))
    finally:
        out.flush()
