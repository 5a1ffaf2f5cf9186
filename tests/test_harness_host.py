"""``pocketllm host`` / ``pocketllm connect`` as subprocesses, and the KV snapshot facility they rest on."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import httpx
import pytest
import torch
from harness_utils import FRANCE, FUZZ_LINES, USAGE_KEYS, HostProcess, check_running_id_refused, fuzz_lines

from pocketllm.harness.protocol import LINE_TOO_LONG, MAX_LINE_BYTES

pytestmark = pytest.mark.usefixtures("smollm2_gguf")

IDLE_EXPIRY_MS = 2000
# A long, fixed system prompt: its prefill dominates a cold turn.
SYSTEM = " ".join(f"Fact {i}: the archive keeps record number {i * 7} on shelf {i % 13}." for i in range(30))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv-store"))


@pytest.fixture(scope="module")
def host(store):
    proc = HostProcess("--kv-store", store, "--max-conns", "3", "--idle-expiry", str(IDLE_EXPIRY_MS),
                       "--ctx", "2048")
    try:
        proc.wait_listening()
        conn = proc.connect()
        proc.first_health = conn.call({"op": "health", "id": 0})
        conn.close()
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_health_loading_then_ready(host):
    assert host.first_health["state"] == "loading"
    conn = host.connect()
    try:
        health = conn.call({"op": "health", "id": 1})
        assert health == {"id": 1, "state": "ready", "model": host.first_health["model"]}
    finally:
        conn.close()


def test_web_client_is_served_from_the_same_port(host):
    base = f"http://127.0.0.1:{host.port}"
    page = httpx.get(base + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "app.js" in page.text and "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(base + "/app.js").headers["content-type"].startswith(("text/javascript",
                                                                           "application/javascript"))
    for path in ("/nope.js", "/../../pyproject.toml", "/%2e%2e/%2e%2e/pyproject.toml", "/..%2f..%2fsetup.py"):
        assert httpx.get(base + path).status_code == 404, path


def _raw_get(port: int, headers: str) -> bytes:
    """The status line and headers of a GET / sent with exactly ``headers``."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\n{headers}\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    return reply.split(b"\r\n\r\n", 1)[0]


def test_dns_rebinding_and_foreign_origins_are_refused(host):
    """A request for a foreign Host name (a DNS-rebound page) is refused, so is a WebSocket opened by another
    site's page (its Origin); the host's own origin, and clients that send no Origin, go on to the token."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    assert _raw_get(host.port, f"Host: attacker.example:{host.port}\r\n").startswith(b"HTTP/1.1 403")
    assert _raw_get(host.port, f"Host: localhost:{host.port}\r\n").startswith(b"HTTP/1.1 200")
    upgrade = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n" \
              "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    assert _raw_get(host.port, f"Host: attacker.example:{host.port}\r\n{upgrade}").startswith(b"HTTP/1.1 403")
    for origin in ("http://attacker.example", f"http://localhost:{host.port}", "null"):
        with pytest.raises(InvalidStatus) as info:
            connect(host.url, origin=origin, open_timeout=10)
        assert info.value.response.status_code == 403, origin
    with connect(host.url, origin=f"http://127.0.0.1:{host.port}", open_timeout=10) as ws:   # the web client's
        ws.send(json.dumps({"op": "auth", "id": 1, "token": host.token}))
        assert json.loads(ws.recv(timeout=30)) == {"id": 1, "auth": "ok"}


def test_every_connection_must_authenticate_first(host):
    conn = host.connect(auth=False)
    conn.send({"op": "health", "id": 1})
    reply = conn.router.first(1)
    assert "authenticate first" in reply["error"]
    assert conn.wait_closed() == 1008

    conn = host.connect(auth=False)
    conn.send({"op": "auth", "id": "a", "token": host.token + "x"})
    assert conn.router.first("a") == {"id": "a", "error": "wrong token"}
    assert conn.wait_closed() == 1008

    conn = host.connect(auth=False)
    conn.send({"op": "auth", "id": "a"})
    assert "token" in conn.router.first("a")["error"]
    assert conn.wait_closed() == 1008

    conn = host.connect(auth=False)
    conn.send("not json at all")
    assert "authenticate first" in conn.router.untagged_matching(lambda x: "error" in x)["error"]
    assert conn.wait_closed() == 1008

    conn = host.connect()          # the right token, then a wrong one later also ends the connection
    assert conn.call({"op": "auth", "id": "again", "token": host.token}) == {"id": "again", "auth": "ok"}
    conn.send({"op": "auth", "id": "bad", "token": "guess"})
    assert conn.router.first("bad")["error"] == "wrong token"
    assert conn.wait_closed() == 1008


def test_a_token_with_a_lone_surrogate_is_a_wrong_token(host):
    """Before and after authenticating, such a token is refused like any wrong one (an error line, then close
    code 1008); it used to close the connection silently first, and to get an internal error (the connection
    left open) after."""
    token = host.token + "\ud800"   # sent as the JSON escape \ud800 (json.dumps escapes it)
    conn = host.connect(auth=False)
    conn.send({"op": "auth", "id": "a", "token": token})
    assert conn.router.first("a", timeout=30) == {"id": "a", "error": "wrong token"}
    assert conn.wait_closed() == 1008

    conn = host.connect()
    conn.send({"op": "auth", "id": "b", "token": token})
    assert conn.router.first("b", timeout=30) == {"id": "b", "error": "wrong token"}
    assert conn.wait_closed() == 1008


def _connect_when_free(host, attempts: int = 50):
    for _ in range(attempts):
        conn = host.connect(auth=False)
        conn.send({"op": "auth", "id": "auth", "token": host.token})
        reply = conn.router.wait_for(lambda c=conn: c.router.all[:1] or None)[0]
        if reply.get("auth") == "ok":
            return conn
        conn.close()
        time.sleep(0.1)
    raise AssertionError("no connection slot came free")


def test_max_conns_is_enforced_with_a_clear_refusal(host):
    # Connections that have not authenticated take no slot (a process without the token used to hold them all).
    waiting = [host.connect(auth=False) for _ in range(4)]
    conns = [_connect_when_free(host) for _ in range(3)]
    try:
        extra = host.connect(auth=False)
        refusal = extra.call({"op": "auth", "id": "a", "token": host.token})   # counted once authenticated
        assert "too many connections" in refusal["error"] and "--max-conns" in refusal["error"]
        assert extra.wait_closed() == 1013
        from pocketllm.errors import InvalidRequestError
        from pocketllm.harness.client import HostClient

        with pytest.raises(InvalidRequestError, match="too many connections"):   # what `connect` reports
            HostClient(str(host.port), host.token)
        conns.pop().close()
        conns.append(_connect_when_free(host))
        assert conns[-1].call({"op": "health", "id": 1})["state"] == "ready"
    finally:
        for conn in conns + waiting:
            conn.close()


def test_the_oldest_connection_waiting_to_authenticate_makes_room(host):
    from pocketllm.harness.host import MAX_PENDING_AUTH

    waiting = [host.connect(auth=False) for _ in range(MAX_PENDING_AUTH + 1)]
    try:
        assert waiting[0].wait_closed() == 1013
        assert waiting[-1].call({"op": "auth", "id": "a", "token": host.token}) == {"id": "a", "auth": "ok"}
    finally:
        for conn in waiting:
            conn.close()


def test_ops_finish_reasons_and_errors_over_websocket(host):
    conn = _connect_when_free(host)
    try:
        text, done = conn.request({"op": "chat", "id": 1, "messages": FRANCE, "temp": 0, "diag": True})
        assert text == "The capital of France is Paris." and done["finish"] == "eos"
        assert set(done["usage"]) == USAGE_KEYS and done["diag"]["route"]["device"] == "cpu"
        assert conn.request({"op": "generate", "id": 2, "prompt": "The sky", "n": 3, "temp": 0})[1]["finish"] == \
            "budget"
        text, done = conn.request({"op": "chat", "id": 3, "messages": FRANCE, "temp": 0, "stop": "Paris"})
        assert (text, done["finish"]) == ("The capital of France is ", "stop")
        story = [{"role": "user", "content": "Write a very long story about a dragon."}]
        conn.send({"op": "chat", "id": 4, "messages": story, "n": 1000, "temp": 0.8, "seed": 3})
        assert "chunk" in conn.router.first(4)
        conn.send({"op": "cancel", "id": 4})
        assert conn.router.collect(4)[1]["finish"] == "cancel"
        conn.send("{broken")
        assert conn.router.untagged_matching(lambda x: "error" in x)["id"] is None
        assert "'temperature'" in conn.request({"op": "chat", "id": 5, "messages": FRANCE,
                                                "temperature": 0})[1]["error"]
        assert conn.call({"op": "health", "id": 6})["state"] == "ready"   # the connection survived
    finally:
        conn.close()


def test_sessions_multiplexed_over_one_connection_and_across_connections(host):
    a = _connect_when_free(host)
    b = _connect_when_free(host)
    try:
        sids = [f"mux-{i}" for i in range(4)]
        for sid in sids:
            assert a.call({"op": "open", "id": f"open-{sid}", "session": sid})["session"] == sid
        questions = ["What is the capital of France?", "Name a fruit.", "What is 3 + 4?", "Say hi."]
        for i, (sid, question) in enumerate(zip(sids, questions)):
            a.send({"op": "chat", "id": i, "session": sid, "temp": 0, "n": 20,
                    "messages": [{"role": "user", "content": question}]})
        assert b.call({"op": "open", "id": "ob", "session": "mux-b"})["resumed"] is False
        b_text, b_done = b.request({"op": "chat", "id": 0, "session": "mux-b", "messages": FRANCE, "temp": 0})
        results = [a.router.collect(i) for i in range(4)]
        assert all(done.get("done") for _, done in results)
        assert results[0][0] == b_text == "The capital of France is Paris."
        chunk_ids = [line["id"] for line in a.router.all if "chunk" in line]
        first_done = next(i for i, line in enumerate(a.router.all) if line.get("done"))
        assert len(set(chunk_ids[:first_done])) >= 2   # interleaved, not one after another
        # A session is used only on the connection that opened it; opening it elsewhere takes it over.
        assert "not open on this connection" in b.request(
            {"op": "chat", "id": 1, "session": "mux-0", "messages": FRANCE})[1]["error"]
        assert a.call({"op": "open", "id": "keep", "session": "mux-0"})["resumed"] is True  # (touches it)
        taken = b.call({"op": "open", "id": "take", "session": "mux-0"})
        assert taken["resumed"] is True and taken["messages"][-1]["content"] == results[0][0]
        notice = a.router.untagged_matching(lambda x: x.get("session") == "mux-0" and "detached" in x)
        assert notice["detached"] == "opened on another connection"
        busy = b.request({"op": "chat", "id": 2, "session": "mux-0", "messages": FRANCE, "n": 2})
        assert busy[1]["done"]
        for sid in sids[1:]:
            assert a.call({"op": "close", "id": f"close-{sid}", "session": sid})["closed"] is True
    finally:
        a.close()
        b.close()


def test_idle_sessions_expire(host):
    conn = _connect_when_free(host)
    try:
        assert conn.call({"op": "open", "id": 1, "session": "idle-one"})["resumed"] is False
        start = time.monotonic()
        notice = conn.router.untagged_matching(lambda x: x.get("session") == "idle-one", timeout=30)
        assert notice == {"id": None, "session": "idle-one", "expired": True}
        assert time.monotonic() - start >= IDLE_EXPIRY_MS / 1000 - 0.5
        assert "not open" in conn.request({"op": "chat", "id": 2, "session": "idle-one",
                                           "messages": FRANCE})[1]["error"]
        assert conn.call({"op": "open", "id": 3, "session": "idle-one"})["resumed"] is False
    finally:
        conn.close()


def test_fuzz_lines_over_websocket(host):
    conn = _connect_when_free(host)
    try:
        lines = [line for line in fuzz_lines(FUZZ_LINES, random.Random(99)) if line.strip()]
        for line in lines:
            conn.ws.send(line.decode("utf-8", "replace"))
        assert conn.call({"op": "health", "id": "after-fuzz"}, timeout=120)["state"] == "ready"
        errors = [x for x in conn.router.all if set(x) == {"id", "error"}]
        assert len(errors) == len(lines)
    finally:
        conn.close()


def test_an_id_with_a_lone_surrogate_keeps_the_connection_answering(host):
    """A line whose id holds a lone surrogate (sent as the JSON escape) is answered with the id escaped, and
    the connection goes on answering: a generation and a health check after it."""
    surrogate = "\ud800"
    conn = _connect_when_free(host)
    try:
        assert conn.call({"op": "health", "id": surrogate})["state"] == "ready"
        assert "not valid Unicode" in conn.call({"op": "generate", "id": "b" + surrogate,
                                                 "prompt": "x" + surrogate})["error"]
        _, done = conn.request({"op": "generate", "id": 2, "prompt": "Once upon a time", "n": 3, "temp": 0})
        assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 3
        assert conn.call({"op": "health", "id": 3})["state"] == "ready" and not conn.closed.is_set()
    finally:
        conn.close()


def _health_line(request_id: str, size: int) -> str:
    """A health request padded with spaces to ``size`` bytes."""
    line = f'{{"op":"health","id":"{request_id}"'
    return line + " " * (size - len(line) - 1) + "}"


def test_a_message_over_the_limit_is_answered_and_the_connection_carries_on(host):
    """A message over 8 MiB is answered with an untagged error, as an overlong line on the pipe, and not read; the
    connection goes on: a turn running meanwhile finishes, its session keeps the conversation (the host used to
    close the connection, code 1009, and cancel the turn)."""
    from pocketllm.harness.host import MAX_MESSAGE_BYTES

    conn = _connect_when_free(host)
    try:
        assert conn.call({"op": "open", "id": "o", "session": "beside-long"})["resumed"] is False
        conn.send({"op": "chat", "id": 1, "session": "beside-long", "messages": FRANCE, "temp": 0})
        conn.send(_health_line("at-limit", MAX_LINE_BYTES))
        conn.send(_health_line("over-limit", MAX_LINE_BYTES + 1))
        conn.ws.send(b"x" * MAX_MESSAGE_BYTES)   # binary, as large as the host reads
        assert conn.router.first("at-limit", timeout=60)["state"] == "ready"
        for _ in range(2):
            assert conn.router.untagged_matching(lambda x: x.get("error") == LINE_TOO_LONG, timeout=60)
        text, done = conn.router.collect(1)
        assert text == "The capital of France is Paris." and done["finish"] == "eos"
        _, done = conn.request({"op": "chat", "id": 2, "session": "beside-long", "temp": 0, "n": 4,
                                "messages": [{"role": "user", "content": "And of Italy?"}], "diag": True})
        assert done["diag"]["prefill"]["cached_tokens"] > 0   # the first turn is in the session
        assert "over-limit" not in conn.router.by_id and not conn.closed.is_set()
        conn.call({"op": "close", "id": "c", "session": "beside-long"})
    finally:
        conn.close()


def test_a_message_past_what_the_host_reads_closes_the_connection_with_1009(host):
    from websockets.exceptions import ConnectionClosed

    from pocketllm.harness.host import MAX_MESSAGE_BYTES

    conn = _connect_when_free(host)
    try:
        try:
            conn.ws.send(b"x" * (MAX_MESSAGE_BYTES + 1))
        except (ConnectionClosed, OSError):
            pass   # the host may close before the whole message is sent
        assert conn.wait_closed(30) == 1009
    finally:
        conn.close()
    conn = _connect_when_free(host)   # the host carries on
    try:
        assert conn.call({"op": "health", "id": 1})["state"] == "ready"
    finally:
        conn.close()


def test_a_request_reusing_a_running_id_is_refused_untagged(host):
    """On a connection, a line reusing the id of a running request is refused with an untagged error naming the
    id; the request runs on; its id is free again once it has ended. Ids are per connection."""
    conn, other = _connect_when_free(host), _connect_when_free(host)
    try:
        def other_connection_keeps_its_ids() -> None:
            assert other.call({"op": "health", "id": "dup"})["state"] == "ready"

        check_running_id_refused(conn, 1000, seed=5, meanwhile=other_connection_keeps_its_ids)
    finally:
        conn.close()
        other.close()


def _turn(conn, request_id, sid, content, **extra):
    return conn.request({"op": "chat", "id": request_id, "session": sid, "temp": 0, "n": 12,
                         "messages": [{"role": "user", "content": content}], **extra})


@pytest.fixture(scope="module")
def restarted(host, store):
    """Host A runs two identical conversations; S1 stops after its first turn, S2 goes on (the uninterrupted
    reference). Then A is shut down with the shutdown op and host B starts on the same kv-store."""
    conn = _connect_when_free(host)
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is on shelf 3?"}]
    assert conn.call({"op": "open", "id": "o1", "session": "kv-s1", "messages": first_turn[:1]})
    s1_text, s1_done = conn.request({"op": "chat", "id": 1, "session": "kv-s1", "temp": 0, "n": 12,
                                     "messages": first_turn[1:], "diag": True})
    assert s1_done["diag"]["prefill"]["mode"] == "cold"
    assert conn.call({"op": "open", "id": "o2", "session": "kv-s2", "messages": first_turn[:1]})
    s2_text, _ = conn.request({"op": "chat", "id": 2, "session": "kv-s2", "temp": 0, "n": 12,
                               "messages": first_turn[1:]})
    assert s2_text == s1_text
    reference, _ = _turn(conn, 3, "kv-s2", "And what is on shelf 5?")
    drain = conn.call({"op": "shutdown", "id": "stop"})
    assert drain["state"] == "draining"
    assert host.proc.wait(60) == 0, host.error_output()
    b = HostProcess("--kv-store", store, "--ctx", "2048")
    conn.close()
    try:
        b.wait_ready()
        yield {"host": b, "cold": s1_done, "s1_text": s1_text, "reference": reference}
    finally:
        b.stop()


def test_kv_store_resumes_warm_after_a_restart(restarted):
    b = restarted["host"]
    conn = b.connect()
    try:
        opened = conn.call({"op": "open", "id": "o", "session": "kv-s1"})
        assert opened["resumed"] is True and opened["stored_tokens"] > 400
        assert [m["role"] for m in opened["messages"]] == ["system", "user", "assistant"]
        assert opened["messages"][-1]["content"] == restarted["s1_text"]
        text, done = _turn(conn, 1, "kv-s1", "And what is on shelf 5?", diag=True)
        assert text == restarted["reference"]          # the same greedy continuation as without the restart
        diag = done["diag"]
        assert diag["kv_store"]["restored_tokens"] >= 400
        assert diag["prefill"]["mode"] == "prefix-cached" and diag["prefill"]["cached_tokens"] >= 400
        cold = restarted["cold"]
        assert cold["diag"]["prefill"]["cached_tokens"] == 0
        assert cold["diag"]["prefill"]["computed_tokens"] == cold["usage"]["prompt_tokens"]
        # A longer prompt than the cold turn's, yet fewer tokens computed: the restored prefix is not recomputed.
        assert done["usage"]["prompt_tokens"] > cold["usage"]["prompt_tokens"]
        prefill = diag["prefill"]
        assert prefill["prompt_tokens"] == done["usage"]["prompt_tokens"]
        assert prefill["computed_tokens"] == prefill["prompt_tokens"] - prefill["cached_tokens"]
        assert prefill["computed_tokens"] < cold["usage"]["prompt_tokens"], (prefill, cold["usage"])
    finally:
        conn.close()


def test_connect_cli_resumes_a_session_and_drives_it(restarted):
    from pocketllm.errors import InvalidRequestError
    from pocketllm.harness.client import HostClient, parse_address

    b = restarted["host"]
    # kv-s2 was left on host A's kv-store; the terminal client resumes it and carries on.
    run = subprocess.run([sys.executable, "-m", "pocketllm", "connect", f"127.0.0.1:{b.port}", "--token", b.token,
                          "--session", "kv-s2"], input="What is the capital of France?\n/exit\n",
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "resumed session kv-s2" in run.stderr and "--session kv-s2" in run.stderr
    assert "> What is on shelf 3?" in run.stdout and restarted["reference"] in run.stdout   # the history
    answer = run.stdout.split(restarted["reference"], 1)[1]
    assert run.stderr.count("tokens, finish ") == 1 and any(c.isalpha() for c in answer)
    with pytest.raises(InvalidRequestError, match="wrong token"):
        HostClient(str(b.port), "not-the-token")
    assert parse_address("9000") == ("127.0.0.1", 9000) and parse_address("[::1]:80") == ("::1", 80)


def test_kv_snapshot_export_import_roundtrip_and_refusal(tmp_path, tiny_checkpoint):
    from pocketllm import SamplingParams
    from pocketllm.api import LLM, KVSnapshot
    from pocketllm.errors import InvalidRequestError

    model = tiny_checkpoint("llama")
    prompt = list(range(100, 141))                      # 41 tokens: two whole blocks and a bit
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=model, num_kv_blocks=64, max_model_len=256) as first:
        out = first.generate([prompt], params)[0]
        tokens = prompt + out.token_ids
        snapshot = first.export_prefix(tokens)
        assert snapshot.num_tokens == 48 and snapshot.token_ids == tokens[:48]
        path = str(tmp_path / "prefix.kv.safetensors")
        snapshot.save(path)
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    assert "pocketllm_kv" in header["__metadata__"]
    loaded = KVSnapshot.load(path)
    assert loaded.token_ids == snapshot.token_ids and loaded.identity == snapshot.identity
    assert all((a == b).all() for a, b in zip(loaded.keys, snapshot.keys))
    forged = KVSnapshot({**loaded.identity, "model": "another-model"}, loaded.token_ids, loaded.keys, loaded.values)
    with LLM(model=model, num_kv_blocks=64, max_model_len=256) as second:
        with pytest.raises(InvalidRequestError, match="model"):
            second.import_prefix(forged)
        assert second.import_prefix(loaded) == 48
        again = second.generate([tokens[:45]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert again.usage.cached_tokens == 32
        rerun = second.generate([prompt], params)[0]
        assert rerun.token_ids == out.token_ids and rerun.usage.cached_tokens == 32
    with LLM(model=model, num_kv_blocks=64, max_model_len=256, block_size=32) as other:
        with pytest.raises(InvalidRequestError, match="block_size"):
            other.import_prefix(loaded)


def test_kv_store_writes_each_turn_as_an_increment(tmp_path, tiny_checkpoint):
    """A session's KV is stored as increments: a turn that extends the conversation writes only its new blocks,
    one that departs from the stored tokens rewrites from the increment where they part; the increments join
    back into the whole prefix, which imports like a single snapshot."""
    from pocketllm import SamplingParams
    from pocketllm.api import LLM
    from pocketllm.errors import InvalidRequestError
    from pocketllm.harness.sessions import Session, SessionStore

    model = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    store, session = SessionStore(str(tmp_path)), Session("s1")

    def save_turn(llm: LLM, tokens: list[int]) -> int:
        start = session.kv_increment_start(tokens)
        increment = llm.export_prefix(tokens, start)
        store.save("s1", {"version": 1, "token_ids": tokens}, increment)
        session.kv_stored(start, increment)
        return start

    with LLM(model=model, num_kv_blocks=64, max_model_len=256) as llm:
        turn1 = list(range(100, 141))
        turn1 += llm.generate([turn1], params)[0].token_ids               # 49 tokens: 3 whole blocks
        assert save_turn(llm, turn1) == 0 and store.kv_parts("s1") == [0]
        turn2 = turn1 + list(range(300, 330))
        turn2 += llm.generate([turn2], params)[0].token_ids               # 87 tokens: 5 whole blocks
        assert save_turn(llm, turn2) == 48 and store.kv_parts("s1") == [0, 48]
        whole = llm.export_prefix(turn2)
        with pytest.raises(InvalidRequestError, match="first_token"):
            llm.export_prefix(turn2, 10)
        joined, parts = store.load_kv("s1")
        assert parts == [0, 48] and joined.token_ids == whole.token_ids == session.stored_tokens
        assert all(torch.equal(a, b) for a, b in zip(joined.keys + joined.values, whole.keys + whole.values))
        increment = llm.export_prefix(turn2, 48)
        with pytest.raises(InvalidRequestError, match="join"):
            llm.import_prefix(increment)
        departed = turn2[:60] + list(range(500, 540))                   # parts from the stored tokens at 60
        llm.generate([departed], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        assert save_turn(llm, departed) == 48 and store.kv_parts("s1") == [0, 48]
        assert store.load_kv("s1")[0].token_ids == departed[:96]
    with LLM(model=model, num_kv_blocks=64, max_model_len=256) as fresh:
        assert fresh.import_prefix(store.load_kv("s1")[0]) == 96
    store.delete("s1")
    assert store.kv_parts("s1") == [] and store.load_kv("s1") == (None, [])


def test_web_dir_serves_another_client_and_nothing_outside_it(tmp_path):
    from pocketllm.cli.main import main
    from pocketllm.harness.host import StaticFiles, builtin_web_dir

    site = tmp_path / "site"
    (site / "assets").mkdir(parents=True)
    (site / "index.html").write_text("<p>mine</p>")
    (site / "assets" / "a.css").write_text("p {}")
    (tmp_path / "secret.txt").write_text("no")
    files = StaticFiles(str(site), csp=None)
    assert files.lookup("/") == str(site / "index.html")
    assert files.lookup("/assets/a.css?v=1") == str(site / "assets" / "a.css")
    for path in ("/../secret.txt", "/assets/../../secret.txt", "/assets", "/missing.html", "/..\\secret.txt"):
        assert files.lookup(path) is None, path
    builtin = StaticFiles(builtin_web_dir(), csp=None)
    assert all(builtin.lookup(f"/{name}") for name in ("index.html", "app.js", "markdown.js", "style.css"))
    with pytest.raises(SystemExit, match="no index.html"):
        main(["host", "--web", str(tmp_path / "assets-only")])


def test_sigkill_mid_turn_keeps_the_stored_history(tmp_path):
    """A host killed (SIGKILL) while a turn generates, restarted on the same KV store: the session resumes with
    its finished turn word for word, its stored KV warms the next turn, and no half-written file is left."""
    store = tmp_path / "store"
    first = HostProcess("--kv-store", str(store), "--ctx", "1024")
    try:
        first.wait_ready()
        conn = first.connect()
        assert conn.call({"op": "open", "id": "o", "session": "killed"})["resumed"] is False
        text1, _ = conn.request({"op": "chat", "id": 1, "session": "killed", "messages": FRANCE, "temp": 0})
        story = [{"role": "user", "content": "Tell me a very long story about a dragon."}]
        conn.send({"op": "chat", "id": 2, "session": "killed", "messages": story, "temp": 0, "n": 600})
        conn.router.first(2)   # the turn has begun generating
        first.proc.kill()
        assert first.proc.wait(60) == -9
        conn.close()
    finally:
        first.stop()
    second = HostProcess("--kv-store", str(store), "--ctx", "1024")
    try:
        second.wait_ready()
        assert not [p.name for p in store.iterdir() if ".tmp-" in p.name]   # removed at start, if any
        conn = second.connect()
        opened = conn.call({"op": "open", "id": "o", "session": "killed"})
        assert opened["resumed"] is True, opened
        messages = opened["messages"]
        assert messages[:2] == [FRANCE[0], {"role": "assistant", "content": text1}], messages
        assert len(messages) in (2, 4)   # the killed turn only if it had finished and been saved
        _, done = conn.request({"op": "chat", "id": 3, "session": "killed", "temp": 0, "n": 4, "diag": True,
                                "messages": [{"role": "user", "content": "And of Italy?"}]})
        assert done.get("done"), done
        assert done["diag"]["kv_store"]["restored_tokens"] > 0
        assert done["diag"]["prefill"]["cached_tokens"] > 0
        conn.close()
    finally:
        second.stop()
