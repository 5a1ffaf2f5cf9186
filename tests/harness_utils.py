"""Driving ``pocketllm pipe`` and ``pocketllm host`` subprocesses (and host connections) from tests."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from server_utils import OutputLines

TIMEOUT = 120.0
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
USAGE_KEYS = {"prompt_tokens", "gen_tokens", "prefill_ms", "decode_ms"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


class Router:
    """Lines routed by id; ``collect`` waits for one request's chunks and its final line."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.by_id: dict[Any, list[dict]] = {}
        self.untagged: list[dict] = []
        self.all: list[dict] = []

    def put(self, obj: dict) -> None:
        with self.cond:
            self.all.append(obj)
            key = obj.get("id")
            if key is None:
                self.untagged.append(obj)
            else:
                self.by_id.setdefault(key, []).append(obj)
            self.cond.notify_all()

    def wait_for(self, predicate, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = predicate()
                if found:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out; last lines: {self.all[-5:]}")
                self.cond.wait(left)

    def first(self, request_id: Any, timeout: float = TIMEOUT) -> dict:
        """The first line carrying ``request_id`` (taken off the list)."""
        def found():
            lines = self.by_id.get(request_id)
            return lines.pop(0) if lines else None
        return self.wait_for(found, timeout)

    def collect(self, request_id: Any, timeout: float = TIMEOUT) -> tuple[str, dict]:
        """(the streamed text, the done or error line) of one request."""
        def found():
            lines = self.by_id.get(request_id, [])
            for i, line in enumerate(lines):
                if line.get("done") or "error" in line:
                    del self.by_id[request_id]
                    return "".join(x.get("chunk", "") for x in lines[:i]), line
            return None
        return self.wait_for(found, timeout)

    def untagged_matching(self, predicate, timeout: float = TIMEOUT) -> dict:
        def found():
            for i, line in enumerate(self.untagged):
                if predicate(line):
                    return self.untagged.pop(i)
            return None
        return self.wait_for(found, timeout)


class PipeProcess:
    """``pocketllm pipe`` with its stdout parsed line by line (a non-JSON line is a protocol violation);
    ``command`` runs another program that serves the protocol (``pocketllm_engine --model DIR``) instead."""

    def __init__(self, *args: str, command: list[str] | None = None) -> None:
        self.stderr = tempfile.TemporaryFile()
        argv = [*command, *args] if command else [sys.executable, "-m", "pocketllm", "pipe", *args]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=_env())
        self.router = Router()
        self.impure: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                obj = json.loads(raw)
                assert isinstance(obj, dict)
            except (ValueError, AssertionError):
                self.impure.append(raw)
                continue
            self.router.put(obj)

    def send(self, line: dict | str | bytes) -> None:
        if isinstance(line, dict):
            line = json.dumps(line)
        if isinstance(line, str):
            line = line.encode("utf-8")
        self.proc.stdin.write(line.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def request(self, obj: dict, timeout: float = TIMEOUT) -> tuple[str, dict]:
        self.send(obj)
        return self.router.collect(obj["id"], timeout)

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send({"op": "health", "id": "ready?"})
            if self.router.first("ready?", timeout)["state"] == "ready":
                return
            time.sleep(0.2)
        raise TimeoutError("the pipe did not become ready")

    def error_output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode("utf-8", "replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class HostProcess:
    """``pocketllm host`` on loopback: on a port the system picks (``--port 0``; the port is read from the
    ``listening on`` line the host prints at once), or on ``port`` (a restart on the port a host just left)."""

    def __init__(self, *args: str, token: str = "s3cret-token", port: int | None = None) -> None:
        self.token = token
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketllm", "host", "--port", str(port or 0), "--token", token, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
        self.output = OutputLines(self.proc, self.proc.stderr)
        self._port = port

    @property
    def port(self) -> int:
        """The port the host bound (the one asked for, else the one it printed)."""
        return self._port if self._port is not None else self.output.listening_port()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def wait_listening(self) -> None:
        """Until the host prints that it listens (its socket is bound and listening by then)."""
        self.output.listening_port()

    def connect(self, auth: bool = True) -> Conn:
        conn = Conn(self.url)
        if auth:
            reply = conn.call({"op": "auth", "id": "auth", "token": self.token})
            assert reply == {"id": "auth", "auth": "ok"}, reply
        return conn

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        self.wait_listening()
        conn = self.connect()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if conn.call({"op": "health", "id": "h"})["state"] == "ready":
                    return
                time.sleep(0.2)
            raise TimeoutError("the host did not become ready")
        finally:
            conn.close()

    def error_output(self) -> str:
        if self.proc.poll() is not None:
            self.output.reader.join(10)
        return self.output.text()[-4000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class Conn:
    """A blocking WebSocket connection with a reader thread routing lines by id."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(url, open_timeout=10, max_size=None, compression=None).__enter__()
        self.router = Router()
        self.close_code: int | None = None
        self.closed = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            while True:
                self.router.put(json.loads(self.ws.recv()))
        except ConnectionClosed as exc:
            self.close_code = exc.rcvd.code if exc.rcvd is not None else None
        finally:
            self.closed.set()
            with self.router.cond:
                self.router.cond.notify_all()

    def send(self, line: dict | str) -> None:
        self.ws.send(json.dumps(line) if isinstance(line, dict) else line)

    def call(self, obj: dict, timeout: float = TIMEOUT) -> dict:
        self.send(obj)
        return self.router.first(obj["id"], timeout)

    def request(self, obj: dict, timeout: float = TIMEOUT) -> tuple[str, dict]:
        self.send(obj)
        return self.router.collect(obj["id"], timeout)

    def wait_closed(self, timeout: float = 10) -> int | None:
        assert self.closed.wait(timeout), "the host did not close the connection"
        return self.close_code

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        self.closed.wait(5)


def checkpoint_without_template(source: str, target: str) -> str:
    """A copy of an HF checkpoint directory whose tokenizer has no chat template."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    config_path = os.path.join(target, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config.pop("chat_template", None)
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    jinja = os.path.join(target, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    return target


# How many lines the JSONL fuzz tests send: 1,000 in ``make test``, 20,000 in ``make soak``.
FUZZ_LINES = int(os.environ.get("POCKETLLM_FUZZ_LINES", "1000"))


def fuzz_lines(count: int, rng: random.Random) -> list[bytes]:
    ops = ["generate", "chat", "health", "cancel", "open", "close", "auth", "shutdown", "nope", "", None, 5]
    values = [None, True, -1, 0, 1.5, "", "x" * 300, [], {}, [1, "a"], {"role": "user"}, float("inf")]
    lines: list[bytes] = []
    while len(lines) < count:
        kind = rng.randrange(8)
        if kind == 0:
            lines.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b" "))
        elif kind == 1:
            good = json.dumps({"op": "generate", "id": rng.randrange(10**6), "prompt": "hi", "n": 1})
            lines.append(good[: rng.randrange(1, len(good) - 1)].encode())
        elif kind == 2:
            lines.append(json.dumps(rng.choice([[], 1, "str", None, [{"op": "health"}]])).encode())
        elif kind == 3:   # an op with a field it does not take
            op = rng.choice(["generate", "chat", "health", "open", "close", "auth"])
            lines.append(json.dumps({"op": op, "id": f"f{len(lines)}", f"extra{rng.randrange(9)}": 1}).encode())
        elif kind == 4:   # a bad value
            field = rng.choice(["n", "temp", "top_k", "top_p", "repeat_penalty", "seed", "stop", "diag", "session",
                                "prompt"])
            bad = {"n": rng.choice([0, -2, 1.5, "3", None]), "temp": rng.choice([-1, "hot", None, []]),
                   "top_k": rng.choice([-1, 2.5, "k"]), "top_p": rng.choice([0, 2, "p"]),
                   "repeat_penalty": rng.choice([0, -1, "r"]), "seed": rng.choice([1.5, "s", None]),
                   "stop": rng.choice([5, [""], [1], {}]), "diag": rng.choice([1, "y", None]),
                   "session": rng.choice(["", "a b", "../x", 7, "x" * 80, "s\n"]),
                   "prompt": rng.choice(["x\ud800", "\udfff", 5, None, ["a"]])}[field]
            lines.append(json.dumps({"op": "generate", "id": f"v{len(lines)}", "prompt": "p", field: bad},
                                    allow_nan=True).encode())
        elif kind == 5:
            lines.append(json.dumps({"op": rng.choice(ops), "id": rng.choice(values[:2] + [1.25, [], {}])},
                                    allow_nan=True).encode())
        elif kind == 6:   # messages of the wrong shape
            lines.append(json.dumps({"op": "chat", "id": f"c{len(lines)}",
                                     "messages": rng.choice(values[:10] + [[{"role": "user", "content": 3}],
                                                                           [{"role": "user", "content": "\ud800"}]])},
                                    allow_nan=True).encode())
        else:             # unknown ops, deep nesting, cancels of nothing
            choice = rng.randrange(3)
            if choice == 0:
                lines.append(json.dumps({"op": f"op{rng.randrange(99)}", "id": len(lines)}).encode())
            elif choice == 1:
                lines.append(b"[" * 5000 + b"]" * 5000)
            else:
                lines.append(json.dumps({"op": "cancel", "id": f"nothing{len(lines)}"}).encode())
    return lines


# --- protocol checks shared by the pipe's tests and the native executable's (any model) ---------------------------

def check_chat_usage_and_diag(pipe: PipeProcess, route_format: str, **fields: Any) -> tuple[str, dict]:
    """A greedy FRANCE chat with ``diag``: the usage keys and values, the route's device and ``route_format``, the
    prefill and prefix-cache fields; the same chat again is prefix-cached with the same text; without ``diag`` the
    done line has none. Returns the first answer's (text, done line)."""
    text, done = pipe.request({"op": "chat", "id": 2, "messages": FRANCE, "temp": 0, "diag": True, **fields})
    assert done["done"] is True
    assert set(done["usage"]) == USAGE_KEYS
    assert done["usage"]["prompt_tokens"] > 10 and done["usage"]["gen_tokens"] > 0
    assert done["usage"]["prefill_ms"] > 0 and done["usage"]["decode_ms"] >= 0
    diag = done["diag"]
    assert diag["route"]["device"] == "cpu" and diag["route"]["format"] == route_format
    assert diag["prefill"]["prompt_tokens"] == done["usage"]["prompt_tokens"]
    assert {"mode", "cached_tokens", "computed_tokens", "chunked"} <= set(diag["prefill"])
    assert "hit_tokens" in diag["prefix_cache"]
    # The same conversation again is served from the prefix cache, with the same greedy answer.
    again, done2 = pipe.request({"op": "chat", "id": "2b", "messages": FRANCE, "temp": 0, "diag": True, **fields})
    assert again == text
    assert done2["diag"]["prefill"]["mode"] == "prefix-cached" and done2["diag"]["prefill"]["cached_tokens"] > 0
    assert "diag" not in pipe.request({"op": "chat", "id": "2c", "messages": FRANCE, "temp": 0, "n": 2})[1]
    return text, done


def check_four_conversations_interleave(pipe: PipeProcess) -> list[tuple[str, dict]]:
    """Four chats sent at once all finish, their chunks interleaved on the pipe (not served one after another);
    returns each one's (text, done line)."""
    questions = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello."]
    for i, question in enumerate(questions):
        pipe.send({"op": "chat", "id": f"m{i}", "messages": [{"role": "user", "content": question}], "temp": 0,
                   "n": 24})
    results = [pipe.router.collect(f"m{i}") for i in range(len(questions))]
    assert all(done.get("done") for _, done in results)
    order = [line["id"] for line in pipe.router.all if str(line.get("id")).startswith("m") and "chunk" in line]
    first_done = min(i for i, line in enumerate(pipe.router.all) if str(line.get("id")).startswith("m")
                     and line.get("done"))
    assert len({line_id for line_id in order[:first_done]}) >= 2
    assert sum(1 for line in pipe.router.all[:first_done]
               if str(line.get("id")).startswith("m") and "chunk" in line) < len(order)
    return results


def check_sessions(pipe: PipeProcess, prefix: str, **first_turn: Any) -> str:
    """Sessions ``PREFIX-a`` (a chat, resumed with its messages and its KV reused; refuses a text op) and
    ``PREFIX-b`` (a text continuing itself), both closed, then refused. ``first_turn``: fields of the first chat
    turn. Returns that turn's answer."""
    a, b = f"{prefix}-a", f"{prefix}-b"
    pipe.send({"op": "open", "id": "o1", "session": a})
    assert pipe.router.first("o1") == {"id": "o1", "session": a, "resumed": False}
    text1, done1 = pipe.request({"op": "chat", "id": "t1", "session": a, "messages": FRANCE, "temp": 0,
                                 **first_turn})
    text2, done2 = pipe.request({"op": "chat", "id": "t2", "session": a, "temp": 0, "n": 16, "diag": True,
                                 "messages": [{"role": "user", "content": "And of Italy?"}]})
    assert done2["usage"]["prompt_tokens"] > done1["usage"]["prompt_tokens"] + done1["usage"]["gen_tokens"] - 2
    assert done2["diag"]["prefill"]["cached_tokens"] > 0   # the first turn's KV is reused
    pipe.send({"op": "open", "id": "o2", "session": a})
    resumed = pipe.router.first("o2")
    assert resumed["resumed"] is True
    assert [m["role"] for m in resumed["messages"]] == ["user", "assistant", "user", "assistant"]
    assert resumed["messages"][1]["content"] == text1 and resumed["messages"][3]["content"] == text2
    _, error = pipe.request({"op": "generate", "id": "t3", "session": a, "prompt": "x"})
    assert "holds a chat conversation" in error["error"]
    # A text session continues its own text.
    pipe.send({"op": "open", "id": "o3", "session": b})
    pipe.router.first("o3")
    part1, _ = pipe.request({"op": "generate", "id": "g1", "session": b, "prompt": "One, two,", "n": 4, "temp": 0})
    part2, done = pipe.request({"op": "generate", "id": "g2", "session": b, "prompt": " and", "n": 3, "temp": 0})
    assert done["usage"]["prompt_tokens"] >= 5
    pipe.send({"op": "open", "id": "o4", "session": b})
    assert pipe.router.first("o4")["text"] == "One, two," + part1 + " and" + part2
    for sid in (a, b):
        pipe.send({"op": "close", "id": f"c-{sid}", "session": sid})
        assert pipe.router.first(f"c-{sid}") == {"id": f"c-{sid}", "session": sid, "closed": True}
    _, error = pipe.request({"op": "chat", "id": "t4", "session": a, "messages": FRANCE})
    assert "not open" in error["error"]
    return text1


def check_fuzz_lines_answered(pipe: PipeProcess) -> None:
    """``FUZZ_LINES`` malformed lines each get one error line, and the pipe is still ready after them."""
    lines = [line for line in fuzz_lines(FUZZ_LINES, random.Random(1234)) if line.strip()]
    before = len(pipe.router.all)
    start = time.monotonic()
    for line in lines:
        pipe.send(line)
    pipe.send({"op": "health", "id": "after-fuzz"})
    assert pipe.router.first("after-fuzz", timeout=120)["state"] == "ready"
    answers = pipe.router.all[before:]
    errors = [a for a in answers if set(a) == {"id", "error"}]
    took = time.monotonic() - start
    assert len(errors) == len(lines), f"{len(lines)} bad lines, {len(errors)} errors, in {took:.1f}s"


def check_sampling_fields(pipe: PipeProcess, echo_tokens: int) -> None:
    """The seed decides a sampled answer (same seed, same text; another seed, another), and ``repeat_penalty``
    changes a greedy answer that repeats its prompt (over ``echo_tokens`` tokens)."""
    prompt = {"op": "generate", "prompt": "Once upon a time", "n": 8, "temp": 1.0, "top_k": 50, "top_p": 0.9,
              "repeat_penalty": 1.1}
    a, _ = pipe.request({**prompt, "id": "s1", "seed": 7})
    b, _ = pipe.request({**prompt, "id": "s2", "seed": 7})
    c, _ = pipe.request({**prompt, "id": "s3", "seed": 8})
    assert a == b and a != c
    echo = {**prompt, "prompt": "apple apple apple apple apple apple", "n": echo_tokens, "temp": 0}
    greedy, _ = pipe.request({**echo, "id": "s4", "repeat_penalty": 1.0})
    penalised, _ = pipe.request({**echo, "id": "s5", "repeat_penalty": 2.0})
    assert greedy != penalised


def check_running_id_refused(channel: PipeProcess | Conn, budget: int, seed: int, meanwhile=None) -> None:
    """A line reusing the id of a running request (a chat of up to ``budget`` tokens, sampled with ``seed``) is
    refused with an untagged error naming the id, whatever its op (a tagged one reads as that request's end); the
    request runs on (``meanwhile()`` is called while it does) until cancelled, every line tagged with the id is
    its own, the refused ``open`` opened nothing, and the id is free again once the request has ended."""
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    channel.send({"op": "chat", "id": "dup", "messages": story, "n": budget, "temp": 0.8, "seed": seed})
    channel.send({"op": "generate", "id": "dup", "prompt": "again", "n": 2})
    channel.send({"op": "open", "id": "dup", "session": "dup-session"})
    channel.send({"op": "health", "id": "dup"})
    for op in ("generate", "open", "health"):
        refusal = channel.router.untagged_matching(lambda x: "'dup'" in x.get("error", ""))
        assert refusal == {"id": None, "error": f"{op} refused: send it with another id "
                                                "(the line's id 'dup' belongs to a request still running)"}
    if meanwhile is not None:
        meanwhile()
    assert "chunk" in channel.router.first("dup")
    channel.send({"op": "cancel", "id": "dup"})
    _, done = channel.router.collect("dup")
    # cancelled while running: chunks, then the done line (no error line, no answer to a refused line)
    assert done["finish"] == "cancel" and done["usage"]["gen_tokens"] < budget, done
    assert "dup" not in channel.router.by_id
    _, error = channel.request({"op": "chat", "id": "after-dup", "session": "dup-session", "messages": FRANCE})
    assert "not open" in error["error"]   # the refused open opened nothing
    channel.send({"op": "health", "id": "dup"})
    assert channel.router.first("dup")["state"] == "ready"
