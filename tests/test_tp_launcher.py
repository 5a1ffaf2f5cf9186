"""Multi-node through an external launcher on CPU (gloo): two ``torchrun`` launchers ("two nodes" on one host)
run the same ``pocketllm`` command line (run, chat, serve, pipe, host, bench); rank 0 runs the command, rank 1
becomes a worker by itself, and the answer is TP=1's. A signal to both launchers lets rank 0 drain (rank 1
holds it until rank 0 stops the group)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any, NamedTuple

import httpx
import pytest
from test_tp import wait_gone

from pocketllm.cli.main import main

ENGINE = ["--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-gb", "0.02", "--max-model-len", "256"]
BIND_ERRORS = ("address already in use", "eaddrinuse", "errno: 98")
WAIT_S = 240
TOKEN = "launcher-test-token"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def launcher(node_rank: int, port: int, command: list[str], log: IO[str], stdin=subprocess.DEVNULL,
             stdout: IO[str] | int | None = None) -> subprocess.Popen:
    """One "node": torchrun with one process, rank ``node_rank`` of two."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "pocketllm", *command]
    return subprocess.Popen(argv, stdin=stdin, stdout=log if stdout is None else stdout, stderr=log, text=True,
                            env=env())


def read(path) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def bind_failed(proc: subprocess.Popen, log_path) -> bool:
    """Whether node 0's launcher exited because the master port was taken between choosing and binding it."""
    return proc.poll() not in (None, 0) and any(e in read(log_path).lower() for e in BIND_ERRORS)


def stop_launchers(launchers: tuple[subprocess.Popen, ...]) -> None:
    """Whatever happened: SIGTERM (torchrun passes it to its rank, then kills that at its own timeout), then
    SIGKILL for a launcher still there."""
    running = [proc for proc in launchers if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Nodes(NamedTuple):
    """What two launchers left: ``drive``'s result (without one: rank 0's stdout), the logs, the exit codes."""

    result: Any
    log0: str
    log1: str
    codes: tuple[int, int]


def two_nodes(tmp_path, command: list[str], drive=None, stdin_text: str | None = None,
              signalled: bool = False) -> Nodes:
    """Start both launchers, let ``drive(node0, log0_path, launchers)`` talk to rank 0 (its stdin and stdout
    pipes, its log), and wait for both launchers to exit: 0 each, unless ``drive`` signalled them
    (``signalled``: torchrun then exits 1 itself, after its ranks). ``stdin_text`` is rank 0's whole stdin.
    The master port is chosen by binding port 0; one taken again before node 0's launcher binds it fails there
    with "address already in use", and the launchers start again on another."""
    for attempt in range(3):
        logs = [tmp_path / f"node{rank}-{attempt}.log" for rank in (0, 1)]
        port = free_port()
        stdin: Any = subprocess.PIPE if drive else subprocess.DEVNULL
        if stdin_text is not None:
            (tmp_path / "stdin.txt").write_text(stdin_text, encoding="utf-8")
            stdin = open(tmp_path / "stdin.txt", encoding="utf-8")
        retry = False
        with open(logs[0], "w", encoding="utf-8") as log0, open(logs[1], "w", encoding="utf-8") as log1:
            node0 = launcher(0, port, command, log0, stdin=stdin, stdout=subprocess.PIPE)
            node1 = launcher(1, port, command, log1)
            try:
                try:
                    driven = drive(node0, logs[0], (node0, node1)) if drive else None
                except Exception:
                    if attempt < 2 and bind_failed(node0, logs[0]):
                        retry = True
                    else:
                        raise
                if not retry:
                    rest, _ = node0.communicate(timeout=WAIT_S)
                    retry = attempt < 2 and bind_failed(node0, logs[0])   # (node 1 waits for it in vain)
                    if not retry:
                        node1.wait(timeout=WAIT_S)
            finally:
                if stdin_text is not None:
                    stdin.close()
                stop_launchers((node0, node1))
        if retry:
            continue
        text = [read(path) for path in logs]
        codes = (node0.returncode, node1.returncode)
        if not signalled:
            assert codes == (0, 0), f"node 0:\n{text[0]}\nnode 1:\n{text[1]}"
        return Nodes(rest if driven is None else driven, text[0], text[1], codes)
    raise AssertionError("unreachable")


def test_run_on_two_launchers_matches_tp1(tiny_checkpoint, tmp_path, capsys) -> None:
    command = ["run", "--model", tiny_checkpoint("llama"), "--prompt", "Hello there", "--temperature", "0",
               "--max-tokens", "8", "--ignore-eos", *ENGINE]
    assert main(command) == 0
    expected = capsys.readouterr().out
    assert expected.strip()
    out, _, log1, _ = two_nodes(tmp_path, [*command, "--tensor-parallel-size", "2",
                                           "--no-tensor-parallel-supervisor"])
    assert out == expected
    assert "Hello" not in log1   # rank 1 printed no answer of its own


def pipe_session(proc: subprocess.Popen, *_: Any) -> str:
    """A generate line, its answer read to the done line, then shutdown; the answer's text."""
    proc.stdin.write(json.dumps({"op": "generate", "id": 1, "prompt": "Hello there", "n": 8, "temp": 0}) + "\n")
    proc.stdin.flush()
    chunks = []
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        reply = json.loads(line)
        if reply.get("id") != 1:
            continue
        assert "error" not in reply, reply
        chunks.append(reply.get("chunk", ""))
        if reply.get("done"):
            break
    proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
    proc.stdin.flush()   # (communicate then closes stdin)
    return "".join(chunks)


def test_pipe_on_two_launchers_matches_tp1(tiny_checkpoint, tmp_path) -> None:
    pipe = ["pipe", "--model", tiny_checkpoint("llama"), "--device", "cpu", "--ctx", "256"]
    settings = {"POCKETLLM_DTYPE": "float32", "POCKETLLM_CPU_KV_CACHE_GB": "0.02"}
    os.environ.update(settings)
    try:
        single = subprocess.Popen([sys.executable, "-m", "pocketllm", *pipe], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env())
        expected = pipe_session(single)
        single.communicate(timeout=WAIT_S)
        assert single.returncode == 0
        assert expected
        out = two_nodes(tmp_path, [*pipe, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"],
                        drive=pipe_session).result
    finally:
        for name in settings:
            os.environ.pop(name)
    assert out == expected


def test_bench_latency_on_two_launchers(tiny_checkpoint, tmp_path) -> None:
    report = tmp_path / "latency.json"
    command = ["bench", "latency", "--model", tiny_checkpoint("llama"), "--input-len", "8", "--output-len", "4",
               "--num-iters", "1", "--warmup-iters", "0", "--output-json", str(report), *ENGINE,
               "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"]
    out, _, log1, _ = two_nodes(tmp_path, command)
    assert "TTFT" in out and "TTFT" not in log1
    assert json.loads(report.read_text(encoding="utf-8"))


def test_bench_throughput_on_two_launchers(tiny_checkpoint, tmp_path) -> None:
    report = tmp_path / "throughput.json"
    command = ["bench", "throughput", "--model", tiny_checkpoint("llama"), "--num-requests", "4", "--min-len", "4",
               "--max-len", "8", "--warmup-requests", "0", "--output-json", str(report), *ENGINE,
               "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"]
    out, _, log1, _ = two_nodes(tmp_path, command)
    assert "pocketllm: 4 requests" in out and "requests" not in log1
    result = json.loads(report.read_text(encoding="utf-8"))
    assert result["pocketllm"]["num_requests"] == 4 and result["engine_args"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize(("variables", "flags", "message"), [
    ({}, ["--tensor-parallel-size", "2"], "RANK and WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, ["--tensor-parallel-size", "2"], "tensor_parallel_size is 2"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["--tensor-parallel-size", "2"], "MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, [], "WORLD_SIZE=2"),
])
def test_inconsistent_launcher_environment_is_one_line(monkeypatch, capsys, variables, flags, message) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TP_RANK", "TP_WORLD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for command in (["run", "--prompt", "hi"], ["chat"], ["serve"], ["pipe"], ["host"], ["bench", "latency"]):
        assert main([*command, *flags, "--no-tensor-parallel-supervisor"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_chat_on_stdin_on_two_launchers_matches_tp1(tiny_checkpoint, tmp_path, capsys, monkeypatch) -> None:
    """``chat`` reading its turns from stdin; the first master port offered is taken (by a listener of ours), so
    the launchers start again on another."""
    command = ["chat", "--model", tiny_checkpoint("llama"), "--temperature", "0", "--max-tokens", "8",
               "--ignore-eos", *ENGINE]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main(command) == 0
    expected = capsys.readouterr().out
    assert "> " in expected and len(expected.strip()) > 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports, chosen = iter([taken.getsockname()[1]]), free_port
        monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(ports, None) or chosen())
        nodes = two_nodes(tmp_path, [*command, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"],
                          stdin_text="Hello there\n")
    assert nodes.result == expected
    assert (tmp_path / "node0-0.log").exists() and (tmp_path / "node0-1.log").exists()   # it started again
    assert any(e in read(tmp_path / "node0-0.log").lower() for e in BIND_ERRORS)


def completions(url: str, max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=WAIT_S, json={
        "model": "m", "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def listening_url(proc: subprocess.Popen, log_path) -> str:
    """``http://127.0.0.1:PORT`` from the ``listening on`` line (``--port 0``) in the process's log."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = re.search(r"^listening on (http://127\.0\.0\.1:\d+)", read(log_path), re.MULTILINE)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening:\n{read(log_path)}")
        time.sleep(0.05)
    raise TimeoutError(f"no 'listening on' line:\n{read(log_path)}")


def rank_pid(launcher: subprocess.Popen) -> int:
    """The one rank a launcher (``--nproc-per-node 1``) started: its child process."""
    children = []
    for task in os.listdir(f"/proc/{launcher.pid}/task"):
        with open(f"/proc/{launcher.pid}/task/{task}/children", encoding="ascii") as handle:
            children += [int(pid) for pid in handle.read().split()]
    assert len(children) == 1, children
    return children[0]


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux: its socket inodes in /proc/net/tcp*, state 0A)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as handle:
            for row in list(handle)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def serve_session(proc: subprocess.Popen, log_path, on_first_chunk=None) -> tuple[str, str, str | None]:
    """An 8-token completion, then a streamed 120-token one (``on_first_chunk`` runs once it streams): both
    texts and the stream's finish reason."""
    url = listening_url(proc, log_path)
    deadline = time.monotonic() + WAIT_S
    while httpx.get(url + "/ready", timeout=WAIT_S).status_code != 200:
        assert proc.poll() is None and time.monotonic() < deadline, read(log_path)
        time.sleep(0.1)
    short = completions(url, 8).json()["choices"][0]["text"]
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            chunks.append(choice["text"])
            finish = choice["finish_reason"] or finish
            if on_first_chunk is not None and len(chunks) == 1:
                on_first_chunk()
    return short, "".join(chunks), finish


@pytest.fixture(scope="module")
def served_tp1(tiny_checkpoint, tmp_path_factory) -> tuple[str, str, str | None]:
    """``serve_session`` against one ``pocketllm serve`` process (TP=1)."""
    log_path = tmp_path_factory.mktemp("serve-tp1") / "serve.log"
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pocketllm", "serve", "--port", "0", "--model",
                                 tiny_checkpoint("llama"), *ENGINE], stdout=log, stderr=log, env=env())
        try:
            result = serve_session(proc, log_path)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(WAIT_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return result


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_on_two_launchers_matches_tp1_and_drains_on_a_signal(tiny_checkpoint, tmp_path, served_tp1,
                                                                    stop) -> None:
    """Rank 0 alone listens; the launchers are signalled while a streamed request runs: rank 1 keeps serving
    rank 0's steps, the request finishes, rank 0 stops the group and both ranks leave on their own."""
    command = ["serve", "--port", "0", "--model", tiny_checkpoint("llama"), *ENGINE, "--shutdown-timeout", "60",
               "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"]

    listening: list[set[int]] = []

    def on_first_chunk(launchers: tuple[subprocess.Popen, ...]) -> None:
        listening[:] = [listening_ports(rank_pid(proc)) for proc in launchers]
        for proc in launchers:
            proc.send_signal(stop)

    def drive(node0: subprocess.Popen, log_path, launchers: tuple[subprocess.Popen, ...]) -> tuple:
        return serve_session(node0, log_path, lambda: on_first_chunk(launchers))

    nodes = two_nodes(tmp_path, command, drive=drive, signalled=True)
    short, long, finish = nodes.result
    http = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", nodes.log0).group(1))
    # Rank 1 listens only where rank 0 does besides HTTP: the collectives' sockets (one a process group).
    assert http in listening[0] and http not in listening[1] and len(listening[1]) == len(listening[0]) - 1
    assert (short, long, finish) == served_tp1 and finish == "length"
    assert "listening on" not in nodes.log1 and "listening on" in nodes.log0
    assert "shutting down: draining" in nodes.log0
    assert "could not send the stop message" not in nodes.log0   # rank 1 was there to receive it
    assert f"rank 1: {stop.name}: serving rank 0's last steps" in nodes.log1
    assert "rank 1: rank 0 stopped the group; leaving" in nodes.log1
    for log in (nodes.log0, nodes.log1):
        assert "forcefully exiting" not in log and "tensor-parallel rank failed" not in log   # nobody killed
        pids = [int(pid) for pid in re.findall(r"Sending process (\d+) closing signal", log)]
        assert len(pids) == 1 and wait_gone(pids, 10)


def host_session(proc: subprocess.Popen, log_path, *_: Any) -> str:
    """An 8-token greedy generate over the WebSocket, then the shutdown operation; the answer's text."""
    from harness_utils import Conn

    url = listening_url(proc, log_path).replace("http://", "ws://") + "/"
    conn = Conn(url)
    try:
        assert conn.call({"op": "auth", "id": "auth", "token": TOKEN}) == {"id": "auth", "auth": "ok"}
        deadline = time.monotonic() + WAIT_S
        while conn.call({"op": "health", "id": "h"})["state"] != "ready":
            assert proc.poll() is None and time.monotonic() < deadline, read(log_path)
            time.sleep(0.1)
        text, done = conn.request({"op": "generate", "id": 1, "prompt": "Hello there", "n": 8, "temp": 0})
        assert done.get("finish") == "budget", done
        conn.send({"op": "shutdown", "id": 2})
        conn.wait_closed(WAIT_S)
    finally:
        conn.close()
    return text


def test_host_on_two_launchers_matches_tp1(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    host = ["host", "--port", "0", "--token", TOKEN, "--model", tiny_checkpoint("llama"), "--device", "cpu",
            "--ctx", "256"]
    monkeypatch.setenv("POCKETLLM_DTYPE", "float32")
    monkeypatch.setenv("POCKETLLM_CPU_KV_CACHE_GB", "0.02")
    log_path = tmp_path / "host-tp1.log"
    with open(log_path, "w", encoding="utf-8") as log:
        single = subprocess.Popen([sys.executable, "-m", "pocketllm", *host], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, env=env())
        try:
            expected = host_session(single, log_path)
            assert single.wait(WAIT_S) == 0
        finally:
            if single.poll() is None:
                single.kill()
                single.wait()
    assert expected
    nodes = two_nodes(tmp_path, [*host, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"],
                      drive=host_session)
    assert nodes.result == expected
    assert "listening on" not in nodes.log1


HOLDER = """
import sys, time
from pocketllm.distributed.supervisor import HeldSignals
HeldSignals(1, float(sys.argv[1])).install()
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("grace", "signals", "said"), [
    ("0.5", [signal.SIGTERM], "rank 0 did not stop the group within 0.5 s; leaving"),
    ("120", [signal.SIGINT, signal.SIGTERM], "rank 1: a second signal (SIGTERM): leaving now"),
])
def test_a_held_signal_ends_the_worker_after_the_grace_or_a_second_signal(grace, signals, said) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, grace], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())
    try:
        assert proc.stdout.readline() == "held\n"
        for number in signals:
            proc.send_signal(number)
            line = proc.stderr.readline()
            assert line.startswith("pocketllm: rank 1: "), line
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert said in line + err
