"""``pocketllm serve --engine-process``: the engine's process dying, and the server's shutdown reaping it."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess

pytestmark = pytest.mark.usefixtures("smollm2_gguf")

CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux: read from /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _engine_pid(proc: ServerProcess) -> int:
    """The engine process (the server's other child is multiprocessing's resource tracker)."""
    engines = [c for c in _children(proc.proc.pid) if "spawn_main" in _cmdline(c)]
    assert len(engines) == 1, [(c, _cmdline(c)) for c in _children(proc.proc.pid)]
    return engines[0]


@pytest.fixture
def server():
    proc = ServerProcess("--engine-process", "--shutdown-timeout", "1")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_the_engine_runs_in_a_child_and_sigterm_leaves_none(server):
    answer = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200, answer.text
    children = _children(server.proc.pid)
    assert _engine_pid(server) in children
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, children))


def test_a_killed_engine_makes_the_server_unhealthy_and_requests_503(server):
    assert httpx.get(server.url + "/health").status_code == 200
    os.kill(_engine_pid(server), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert httpx.get(server.url + "/ready").status_code == 503
    answer = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
    assert answer.status_code == 503 and "engine" in answer.json()["error"]["message"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert "exited unexpectedly" in server.output.text()


def test_a_request_running_when_the_engine_dies_fails_with_a_5xx(server):
    import threading

    result: dict = {}

    def long_request() -> None:
        body = {**CHAT, "max_tokens": 8000, "ignore_eos": True}
        result["response"] = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while not re.search(r"^pocketllm:num_requests_running(?:\{[^}]*\})? 1(?:\.0)?$",
                        httpx.get(server.url + "/metrics").text, re.M):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(_engine_pid(server), signal.SIGKILL)
    worker.join(60)
    assert 500 <= result["response"].status_code < 600


def test_the_servers_default_engine_placement():
    from pocketllm.config import EngineArgs
    from pocketllm.server.app import served_engine_args

    assert served_engine_args(EngineArgs(device="cpu")).engine_process is False
    assert served_engine_args(EngineArgs(device="cuda")).engine_process is True
    assert served_engine_args(EngineArgs(device="cpu", engine_process=True)).engine_process is True
    assert served_engine_args(EngineArgs(device="cuda", engine_process=False)).engine_process is False
    assert served_engine_args(EngineArgs(device="cuda", tensor_parallel_size=2)).engine_process is None
