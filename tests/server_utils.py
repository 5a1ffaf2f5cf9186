"""Starting the real server as a subprocess on 127.0.0.1 and a free port, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

BIND_FAILED = "address already in use"
PORT_ATTEMPTS = 5


def free_port() -> int:
    """A port free now; another process may take it before ours binds, so callers retry on a bind failure."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``pocketllm serve`` in a subprocess; ``url`` is its base address. A server that loses its port to
    another process between ``free_port`` and its bind is restarted on a new one (up to PORT_ATTEMPTS)."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.attempts = 0
        self._start()

    def _start(self) -> None:
        self.attempts += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketllm", "serve", "--port", str(self.port), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_alive(self, timeout: float = 60) -> None:
        self._wait("/alive", timeout)

    def wait_ready(self, timeout: float = 300) -> None:
        self._wait("/ready", timeout)

    def _wait(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.proc.stdout.read()
                if BIND_FAILED in output.lower() and self.attempts < PORT_ATTEMPTS:
                    self._start()
                    continue
                raise RuntimeError(f"server exited early:\n{output}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
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
