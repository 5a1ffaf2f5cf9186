"""How the ``pocketllm`` command ends: Ctrl-C is status 130 without a traceback (while the model loads, while it
generates, while a server serves), a busy port is one line before anything loads, usage errors are one line,
and ``run`` takes its prompt positionally or on stdin.

The tests wait for lines of the command's own output (never for a length of time); the timeouts are only a
safety net against a hung command.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

TIMEOUT = 300.0          # a safety net: how long a line may take to appear on a slow, busy machine
INTERRUPTED = 130
LOADING_WEIGHTS = "Loading weights"   # the loader's progress bar: the weights are being read


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TQDM_DISABLE", None)   # the progress bar is what the load-time tests wait for
    return env


class Command:
    """``pocketllm ARGS`` in a subprocess; its stdout and stderr are collected as they arrive."""

    def __init__(self, *args: str, stdin: int | None = subprocess.PIPE) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pocketllm", *args], stdin=stdin,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
        self.cond = threading.Condition()
        self.text = {"stdout": "", "stderr": ""}
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True)
                        for name in ("stdout", "stderr")]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = getattr(self.proc, name)
        while chunk := os.read(stream.fileno(), 4096):
            with self.cond:
                self.text[name] += chunk.decode("utf-8", "replace")
                self.cond.notify_all()

    def wait_for(self, name: str, needle: str) -> None:
        """Until ``needle`` appears in the stream ``name`` (fails if the command exits first)."""
        with self.cond:
            found = self.cond.wait_for(lambda: needle in self.text[name] or self.proc.poll() is not None,
                                       TIMEOUT)
            assert found and needle in self.text[name], (
                f"{needle!r} never came on {name}; exit {self.proc.poll()}, stderr:\n{self.text['stderr'][-3000:]}")

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the command has exited."""
        status = self.proc.wait(TIMEOUT)
        for reader in self.readers:
            reader.join(TIMEOUT)
        return status, self.text["stdout"], self.text["stderr"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def command() -> Iterator[Callable[..., Command]]:
    started: list[Command] = []

    def start(*args: str, **kwargs: int | None) -> Command:
        cmd = Command(*args, **kwargs)
        started.append(cmd)
        return cmd

    yield start
    for cmd in started:
        cmd.kill()


def _assert_interrupted(status: int, stderr: str) -> None:
    assert status == INTERRUPTED, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert "terminate called" not in stderr and "Aborted" not in stderr, stderr
    assert stderr.rstrip().endswith("pocketllm: interrupted"), stderr[-3000:]


# --- Ctrl-C ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("run", "Hello"), ("chat",), ("serve",), ("host",), ("pipe",)],
                         ids=lambda args: args[0])
def test_ctrl_c_while_the_model_loads(command, smollm2_gguf, args):
    port = ("--port", "0") if args[0] in ("serve", "host") else ()
    cmd = command(*args, *port, "-m", smollm2_gguf)
    cmd.wait_for("stderr", LOADING_WEIGHTS)
    cmd.interrupt()
    status, _, stderr = cmd.finish()
    _assert_interrupted(status, stderr)


@pytest.mark.parametrize("name", ["serve", "host"])
def test_sigterm_while_the_model_loads_exits_without_waiting_for_it(command, smollm2_gguf, name):
    """SIGTERM while the weights load stops the server with status 0 and no traceback, without waiting for the
    load: serve logs "model loaded" when a load ends (also one ended after the signal), and it never comes."""
    cmd = command(name, "--port", "0", "--verbose", "-m", smollm2_gguf, stdin=subprocess.DEVNULL)
    cmd.wait_for("stderr", LOADING_WEIGHTS)
    cmd.proc.send_signal(signal.SIGTERM)
    status, _, stderr = cmd.finish()
    assert status == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr and "Aborted" not in stderr, stderr
    assert "model loaded" not in stderr and "ready: " not in stderr, stderr[-3000:]


def test_ctrl_c_while_run_generates(command, smollm2_gguf):
    cmd = command("run", "Tell me a long story about a dragon.", "-m", smollm2_gguf, "--max-tokens", "1000",
                  "--ignore-eos", "--temperature", "0", stdin=subprocess.DEVNULL)
    cmd.wait_for("stdout", " ")    # the answer has begun
    cmd.interrupt()
    status, stdout, stderr = cmd.finish()
    _assert_interrupted(status, stderr)
    assert stdout.strip()
    assert "tokens, finish" not in stderr    # it did not run to its end


@pytest.mark.parametrize("name", ["serve", "host"])
def test_ctrl_c_stops_a_ready_server(command, tiny_checkpoint, name):
    cmd = command(name, "--port", "0", "-m", tiny_checkpoint("llama"), stdin=subprocess.DEVNULL)
    cmd.wait_for("stderr", "ready: ")
    cmd.interrupt()
    status, _, stderr = cmd.finish()
    _assert_interrupted(status, stderr)
    lines = stderr.splitlines()
    assert re.match(r"listening on http://127\.0\.0\.1:[1-9][0-9]*\b", lines[0]), stderr   # the port it got for 0
    if name == "host":
        assert "/#token=" in lines[0]


# --- a busy port -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["serve", "host"])
def test_a_busy_port_is_one_line_before_loading(command, name):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status, stdout, stderr = command(name, "--port", str(port), stdin=subprocess.DEVNULL).finish()
    assert status != 0
    assert stderr.splitlines() == [f"pocketllm: error: port {port} on 127.0.0.1 is in use"], stderr
    assert "loading" not in stderr.lower() and stdout == ""


# --- usage -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("run", "--no-such-flag"), ("serve", "--port", "x"), ("no-such-command",), ()],
                         ids=["flag", "value", "command", "none"])
def test_usage_errors_are_one_line(command, args):
    status, stdout, stderr = command(*args, stdin=subprocess.DEVNULL).finish()
    assert status == 2
    assert len(stderr.splitlines()) == 1 and "error:" in stderr, stderr
    assert stdout == ""


@pytest.mark.parametrize(("argv", "prog"), [(["run", "Hello", "--no-such-flag"], "pocketllm run"),
                                           (["bench", "latency", "--no-such-flag"], "pocketllm bench latency"),
                                           (["--no-such-flag", "run", "Hello"], "pocketllm")])
def test_an_unknown_flag_is_refused_by_its_command(capsys, argv, prog):
    from pocketllm.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"{prog}: error: unrecognized arguments: --no-such-flag "
                                       f"(see '{prog} --help')\n")


@pytest.mark.parametrize(("flag", "kind"),
                         [("--seed", "int"), ("--cpu-kv-cache-gb", "float"), ("--logit-bias", "JSON")])
def test_a_bad_flag_value_names_the_type_expected(capsys, flag, kind):
    from pocketllm.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["run", "Hello", flag, "{x"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"pocketllm run: error: argument {flag}: invalid {kind} value: '{{x' "
                                       "(see 'pocketllm run --help')\n")


def test_run_without_a_prompt_says_so(command):
    status, _, stderr = command("run", stdin=subprocess.DEVNULL).finish()   # stdin: empty, not a terminal
    assert status == 2 and stderr.splitlines() == ["pocketllm run: error: the prompt is empty"], stderr


def _prompt_tokens(stderr: str) -> str:
    report = [line for line in stderr.splitlines() if "tokens, finish" in line]
    assert len(report) == 1, stderr
    return report[0].split("prompt ", 1)[1].split(" tokens", 1)[0]


def test_run_takes_the_prompt_positionally_or_on_stdin(command, tiny_checkpoint):
    flags = ("-m", tiny_checkpoint("llama"), "--max-tokens", "4", "--temperature", "0", "--ignore-eos")
    prompt = "What is the capital of France?"
    positional = command("run", prompt, *flags, stdin=subprocess.DEVNULL).finish()
    piped = command("run", *flags)
    piped.proc.stdin.write(f"{prompt}\n".encode())
    piped.proc.stdin.close()
    piped = piped.finish()
    for status, _, stderr in (positional, piped):
        assert status == 0, stderr
        assert "[4 tokens, finish length" in stderr and "Traceback" not in stderr
    assert _prompt_tokens(positional[2]) == _prompt_tokens(piped[2])   # the same prompt either way


def test_chat_answers_help_and_unknown_commands_itself(tiny_checkpoint, monkeypatch, capsys):
    """/help (or /?) lists the chat's commands and a mistyped one says so: neither goes to the model."""
    from pocketllm.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO("/help\n/?\n/frobnicate\n/bye\nnever read\n"))
    assert main(["chat", "-m", tiny_checkpoint("llama"), "--max-tokens", "2", "--num-kv-blocks", "64",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "tokens, finish" not in err, err   # nothing was generated
    assert err.count("/clear forgets the conversation") == 4, err   # the greeting, /help, /? and /frobnicate
    assert "[unknown command /frobnicate: " in err, err
