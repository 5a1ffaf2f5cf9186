"""``pocketllm serve --tensor-parallel-size 2`` on CPU (gloo): the supervisor starts rank 0 (HTTP) and rank 1,
the server answers the OpenAI client, and a SIGTERM, a killed worker or a startup timeout each stop and reap the
whole group within the configured timeouts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_tp import gone, wait_gone

SHUTDOWN_TIMEOUT = 8


class Supervised:
    """The supervisor process; its stderr goes to a file so rank pids can be read while it runs."""

    def __init__(self, model: str, log_path: str, rendezvous: str, *extra: str) -> None:
        self._port: int | None = None
        self.log_path = log_path
        self.log = open(log_path, "w", encoding="utf-8")
        argv = [sys.executable, "-m", "pocketllm", "serve", "--port", "0", "--model", model,
                "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-gb", "0.02",
                "--max-model-len", "256", "--tensor-parallel-rendezvous-dir", rendezvous,
                "--tensor-parallel-shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--shutdown-timeout", "2", *extra]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8") as handle:
            return handle.read()

    @property
    def port(self) -> int:
        """The port rank 0 bound for ``--port 0``, from its ``listening on`` line (printed before it loads)."""
        deadline = time.monotonic() + 60
        while self._port is None:
            found = re.search(r"^listening on http://127\.0\.0\.1:(\d+)\b", self.output(), re.MULTILINE)
            if found:
                self._port = int(found.group(1))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not say where it listens:\n{self.output()}")
            else:
                time.sleep(0.05)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rank_pids(self, timeout: float = 60) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = {int(r): int(p) for r, p in re.findall(r"rank (\d+) started \(pid (\d+)\)", self.output())}
            if len(found) == 2:
                return found
            time.sleep(0.05)
        raise TimeoutError(f"the supervisor did not report two ranks:\n{self.output()}")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the supervisor exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"/ready did not answer 200 within {timeout} s:\n{self.output()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the supervisor did not exit within {timeout} s:\n{self.output()}") from None

    def stop(self) -> None:
        """Test cleanup: leave nothing running whatever happened."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in {int(p) for p in re.findall(r"\(pid (\d+)\)", self.output())}:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture
def rendezvous(tmp_path) -> str:
    path = tmp_path / "rendezvous"
    path.mkdir()
    return str(path)


def test_serves_openai_client_and_sigterm_reaps(tiny_checkpoint, tmp_path, rendezvous) -> None:
    server = Supervised(tiny_checkpoint("qwen3"), str(tmp_path / "log"), rendezvous)
    try:
        pids = server.rank_pids()
        server.wait_ready()
        assert len(os.listdir(rendezvous)) == 1   # the private run directory, inside the caller's parent
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        reply = client.completions.create(model="m", prompt="Hello there", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0)
        assert chat.choices[0].message.content is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(SHUTDOWN_TIMEOUT + 10) == 0
        assert wait_gone(list(pids.values()), 5)
        assert os.path.isdir(rendezvous) and os.listdir(rendezvous) == []   # parent kept, run directory removed
    finally:
        server.stop()


def test_killed_worker_stops_the_group(tiny_checkpoint, tmp_path, rendezvous) -> None:
    """(Through a TCP rendezvous at an explicit master address; the supervisor picks the port.)"""
    server = Supervised(tiny_checkpoint("llama"), str(tmp_path / "log"), rendezvous,
                        "--tensor-parallel-master-addr", "127.0.0.1")
    try:
        pids = server.rank_pids()
        server.wait_ready()
        os.kill(pids[1], signal.SIGKILL)
        assert server.wait_exit(SHUTDOWN_TIMEOUT + 10) != 0
        assert wait_gone(list(pids.values()), 5)
        assert "rank 1 exited" in server.output()
        assert os.listdir(rendezvous) == []
    finally:
        server.stop()


def test_startup_timeout_stops_the_group(tiny_checkpoint, tmp_path, rendezvous) -> None:
    server = Supervised(tiny_checkpoint("llama"), str(tmp_path / "log"), rendezvous,
                        "--tensor-parallel-startup-timeout", "0.5")
    try:
        pids = server.rank_pids()
        assert server.wait_exit(0.5 + SHUTDOWN_TIMEOUT + 10) != 0
        assert wait_gone(list(pids.values()), 5)
        assert "not ready within" in server.output()
        assert os.listdir(rendezvous) == []
    finally:
        server.stop()
