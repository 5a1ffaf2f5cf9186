"""Starting the real server as a subprocess on 127.0.0.1, for the server tests.

The server is started with ``--port 0``: it binds a port the system picks and prints it at once
(``listening on http://127.0.0.1:PORT``), so no other process can take the port between its choice and the bind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx

LISTENING = re.compile(r"^listening on http://127\.0\.0\.1:(\d+)\b")
TIMEOUT = 120.0   # a safety net: how long a started command may take to print a line it prints at once


class OutputLines:
    """The lines a subprocess writes on one stream, read as they arrive; ``wait_for`` waits for a pattern."""

    def __init__(self, proc: subprocess.Popen, stream) -> None:
        self.proc = proc
        self.stream = stream
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.stream:
            line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def text(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = TIMEOUT) -> re.Match[str]:
        """The first line matching ``pattern``; fails if the stream closes (the process exited) first."""
        def found() -> re.Match[str] | None:
            return next((m for m in map(pattern.match, self.lines) if m), None)

        with self.cond:
            if not self.cond.wait_for(lambda: found() is not None or self.closed, timeout) or found() is None:
                raise RuntimeError(f"no line matching {pattern.pattern!r} (exit {self.proc.poll()}):\n"
                                   + "\n".join(self.lines[-40:]))
            match = found()
            assert match is not None
            return match

    def listening_port(self) -> int:
        """The port of the process's ``listening on`` line (printed once its socket listens, before the model
        loads)."""
        return int(self.wait_for(LISTENING).group(1))


class ServerProcess:
    """``pocketllm serve --port 0`` in a subprocess; ``port`` and ``url`` are those it printed."""

    def __init__(self, *args: str) -> None:
        self.args = args
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketllm", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output = OutputLines(self.proc, self.proc.stdout)

    @property
    def port(self) -> int:
        """The port the server bound."""
        return self.output.listening_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_alive(self, timeout: float = 60) -> None:
        self._wait("/alive", timeout)

    def wait_ready(self, timeout: float = 300) -> None:
        self._wait("/ready", timeout)

    def _wait(self, path: str, timeout: float) -> None:
        """Poll ``path`` until it answers 200 (the server's own state; the pause between polls only spares
        the CPU, nothing waits on it)."""
        url = self.url + path
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.output.reader.join(10)
                raise RuntimeError(f"server exited early:\n{self.output.text()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{path} did not answer 200 within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
