"""Multi-node through an external launcher on CPU (gloo): two ``torchrun`` launchers ("two nodes" on one host)
run the same ``pocketllm`` command line; rank 0 runs the command, rank 1 becomes a worker by itself, and the
answer is TP=1's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import IO

import pytest

from pocketllm.cli.main import main

ENGINE = ["--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-gb", "0.02", "--max-model-len", "256"]
BIND_ERRORS = ("address already in use", "eaddrinuse", "errno: 98")
WAIT_S = 240


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


def two_nodes(tmp_path, command: list[str], drive=None) -> tuple[str, str, str]:
    """Start both launchers, let ``drive`` talk to rank 0 (its stdin and stdout pipes), wait for both to exit 0;
    what ``drive`` returned (without one: rank 0's stdout) and both logs. A port taken between choosing and
    binding it is chosen again."""
    for attempt in range(3):
        logs = [tmp_path / f"node{rank}-{attempt}.log" for rank in (0, 1)]
        port = free_port()
        with open(logs[0], "w", encoding="utf-8") as log0, open(logs[1], "w", encoding="utf-8") as log1:
            node0 = launcher(0, port, command, log0, stdin=subprocess.PIPE if drive else subprocess.DEVNULL,
                             stdout=subprocess.PIPE)
            node1 = launcher(1, port, command, log1)
            try:
                driven = drive(node0) if drive else None
                rest, _ = node0.communicate(timeout=WAIT_S)
                node1.wait(timeout=WAIT_S)
            finally:
                for proc in (node0, node1):
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
        text = [read(path) for path in logs]
        if node0.returncode != 0 and any(e in text[0].lower() for e in BIND_ERRORS) and attempt < 2:
            continue
        assert (node0.returncode, node1.returncode) == (0, 0), f"node 0:\n{text[0]}\nnode 1:\n{text[1]}"
        return rest if driven is None else driven, text[0], text[1]
    raise AssertionError("unreachable")


def test_run_on_two_launchers_matches_tp1(tiny_checkpoint, tmp_path, capsys) -> None:
    command = ["run", "--model", tiny_checkpoint("llama"), "--prompt", "Hello there", "--temperature", "0",
               "--max-tokens", "8", "--ignore-eos", *ENGINE]
    assert main(command) == 0
    expected = capsys.readouterr().out
    assert expected.strip()
    out, _, log1 = two_nodes(tmp_path, [*command, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"])
    assert out == expected
    assert "Hello" not in log1   # rank 1 printed no answer of its own


def pipe_session(proc: subprocess.Popen) -> str:
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
        out, _, _ = two_nodes(tmp_path, [*pipe, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"],
                              drive=pipe_session)
    finally:
        for name in settings:
            os.environ.pop(name)
    assert out == expected


def test_bench_latency_on_two_launchers(tiny_checkpoint, tmp_path) -> None:
    report = tmp_path / "latency.json"
    command = ["bench", "latency", "--model", tiny_checkpoint("llama"), "--input-len", "8", "--output-len", "4",
               "--num-iters", "1", "--warmup-iters", "0", "--output-json", str(report), *ENGINE,
               "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"]
    out, _, log1 = two_nodes(tmp_path, command)
    assert "TTFT" in out and "TTFT" not in log1
    assert json.loads(report.read_text(encoding="utf-8"))


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
