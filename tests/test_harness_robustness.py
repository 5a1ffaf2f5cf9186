"""Bad input and bad peers cost their own request or connection only: no internal errors for values the protocol
can refuse by name, no token that slips past the check, no idle session kept alive (or another one lost) because
a client stopped reading. These tests need no model."""

from __future__ import annotations

import asyncio
import json

import pytest

from pocketllm.config import EngineArgs
from pocketllm.harness.host import Host, HostConfig
from pocketllm.harness.protocol import LINE_TOO_LONG, MAX_LINE_BYTES, ProtocolError, parse_line
from pocketllm.harness.service import Channel, Harness, Turn
from pocketllm.harness.sessions import Session


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_a_seed_past_64_bits_is_refused_by_name(seed: int) -> None:
    """Such a seed used to reach the engine's generator and come back as an internal error."""
    with pytest.raises(ProtocolError) as info:
        parse_line(json.dumps({"op": "generate", "id": 1, "prompt": "x", "seed": seed}))
    assert "seed must fit in 64 bits" in info.value.message and info.value.request_id == 1


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), -1, 0])
def test_every_64_bit_seed_is_taken(seed: int) -> None:
    assert parse_line(json.dumps({"op": "generate", "id": 1, "prompt": "x", "seed": seed})).get("seed") == seed


def test_a_token_that_is_not_valid_unicode_is_wrong_not_an_error() -> None:
    host = Host(HostConfig(EngineArgs(model="no-model-is-loaded"), token="t\u00e9"))
    assert host.check_token("t\u00e9") and not host.check_token("t\ud800") and not host.check_token(None)


def _harness(idle_expiry_s: float | None = None) -> Harness:
    return Harness(EngineArgs(model="no-model-is-loaded"), idle_expiry_s=idle_expiry_s)


class Recorder:
    """A channel's writes; while ``gate`` is clear a write blocks, as a send to a client that does not read."""

    def __init__(self, blocked: bool = False) -> None:
        self.lines: list[dict] = []
        self.gate = asyncio.Event()
        if not blocked:
            self.gate.set()

    async def __call__(self, line: str) -> None:
        self.lines.append(json.loads(line))
        await self.gate.wait()


def _own(harness: Harness, channel: Channel, sid: str) -> Session:
    session = harness.sessions[sid] = Session(sid, owner=channel)
    channel.sessions.add(sid)
    return session


def test_a_client_that_does_not_read_holds_up_no_other_session_expiry() -> None:
    async def main() -> None:
        harness = _harness(idle_expiry_s=0.1)
        stuck_writes, writes = Recorder(blocked=True), Recorder()
        stuck, other = Channel("stuck", stuck_writes), Channel("other", writes)
        _own(harness, stuck, "a")
        _own(harness, other, "b")
        reaper = asyncio.create_task(harness._expire_idle())
        try:
            await asyncio.sleep(0.6)
            assert harness.sessions == {}
            assert writes.lines == [{"id": None, "session": "b", "expired": True}]
            assert stuck_writes.lines == [{"id": None, "session": "a", "expired": True}]
        finally:
            reaper.cancel()
            stuck_writes.gate.set()
    asyncio.run(main())


def test_expiry_never_removes_a_session_opened_anew_under_the_same_name() -> None:
    """While the reaper's notice to one client is under way, another client closes its idle session and opens it
    again: the new session is kept (it used to be removed in its place, or to end the reaper with a KeyError)."""
    async def main() -> None:
        harness = _harness(idle_expiry_s=0.2)
        stuck_writes, writes = Recorder(blocked=True), Recorder()
        stuck, other = Channel("stuck", stuck_writes), Channel("other", writes)
        _own(harness, stuck, "a")
        old = _own(harness, other, "b")
        old.last_active -= 10   # idle for long: expires at the reaper's next look, together with "a"
        harness.sessions["a"].last_active -= 10
        reaper = asyncio.create_task(harness._expire_idle())
        try:
            while not stuck_writes.lines:   # the notice to "a" is being written
                await asyncio.sleep(0.01)
            harness.sessions.pop("b", None)
            fresh = _own(harness, other, "b")
            stuck_writes.gate.set()
            await asyncio.sleep(0.1)   # less than the idle expiry: the fresh session must stay
            assert harness.sessions.get("b") is fresh and not reaper.done()
        finally:
            reaper.cancel()
    asyncio.run(main())


def test_taking_a_session_over_is_answered_at_once_when_its_old_client_does_not_read() -> None:
    """The old connection's "detached" notice must not hold up the new connection's answer."""
    async def main() -> None:
        harness = _harness()
        stuck_writes, writes = Recorder(blocked=True), Recorder()
        stuck, other = Channel("stuck", stuck_writes), Channel("other", writes)
        _own(harness, stuck, "s")
        try:
            await asyncio.wait_for(harness.handle(other, '{"op":"open","id":1,"session":"s"}'), 5)
            assert writes.lines == [{"id": 1, "session": "s", "resumed": True}]
            assert harness.sessions["s"].owner is other
            await asyncio.sleep(0)
            assert stuck_writes.lines == [{"id": None, "session": "s", "detached": "opened on another connection"}]
        finally:
            stuck_writes.gate.set()
    asyncio.run(main())


def test_a_line_reusing_the_id_of_a_running_request_is_refused_untagged() -> None:
    """Any line but that request's cancel is refused, the error untagged (it used to carry the id, read as the
    running request's end, or the line was served with its answer tagged so) and naming the id; the request runs
    on, nothing the line asked for is done, and once the request has ended its id is free again. Ids are per
    channel."""
    async def main() -> None:
        harness = _harness()
        writes, other_writes = Recorder(), Recorder()
        channel, other = Channel("one", writes), Channel("other", other_writes)
        turn = channel.requests["dup"] = Turn("dup", "engine-id", None)
        lines = [('{"op":"generate","id":"dup","prompt":"again"}', "generate refused: send it with another id"),
                 ('{"op":"chat","id":"dup","messages":[{"role":"user","content":"x"}]}', "chat refused"),
                 ('{"op":"open","id":"dup","session":"s"}', "open refused"),
                 ('{"op":"close","id":"dup","session":"s"}', "close refused"),
                 ('{"op":"health","id":"dup"}', "health refused"),
                 ('{"op":"shutdown","id":"dup"}', "shutdown refused"),
                 ('{"op":"generate","id":"dup"}', "generate needs a non-empty string 'prompt'"),
                 ('{"op":"cancel","id":"dup","x":1}', "unknown field(s) 'x'")]
        for line, reason in lines:
            await harness.handle(channel, line)
            assert writes.lines[-1] == {"id": None, "error": writes.lines[-1]["error"]}, line
            error = writes.lines[-1]["error"]
            assert reason in error and "id 'dup' belongs to a request still running" in error, error
        assert len(writes.lines) == len(lines)
        assert channel.requests == {"dup": turn} and not turn.cancelled
        assert harness.sessions == {} and not harness.draining
        await harness.handle(other, '{"op":"health","id":"dup"}')   # another channel's id
        assert other_writes.lines == [{"id": "dup", "state": "loading", "model": harness.model_label}]
        await harness.handle(channel, '{"op":"cancel","id":"dup"}')   # answered by the request's done line
        assert turn.cancelled and len(writes.lines) == len(lines)
        del channel.requests["dup"]   # the request has ended
        await harness.handle(channel, '{"op":"health","id":"dup"}')
        await harness.handle(channel, '{"op":"cancel","id":"dup"}')
        assert writes.lines[-2:] == [{"id": "dup", "state": "loading", "model": harness.model_label},
                                     {"id": "dup", "error": "no running request with id 'dup'"}]
    asyncio.run(main())


def test_a_line_over_the_limit_is_refused_unread() -> None:
    """The limit both faces share (the pipe's lines, the host's messages, read as bytes): a line of exactly
    ``MAX_LINE_BYTES`` is read, one byte more is refused with an untagged error whatever it holds."""
    health = b'{"op":"health","id":1'
    assert parse_line(health + b" " * (MAX_LINE_BYTES - len(health) - 1) + b"}").id == 1
    with pytest.raises(ProtocolError) as info:
        parse_line(health + b" " * (MAX_LINE_BYTES - len(health)) + b"}")
    assert info.value.message == LINE_TOO_LONG and info.value.request_id is None
    assert "8388608 bytes (8 MiB)" in LINE_TOO_LONG


def test_a_request_frees_its_id_and_session_before_its_last_line_is_written() -> None:
    """A client may reuse the id, and the session, as soon as it reads the request's done or error line (an error
    line used to be written while both were still taken)."""
    async def main() -> None:
        harness = _harness()
        harness.load_error, harness.llm = RuntimeError("no such model"), None
        harness.ready.set()
        seen: list[tuple[dict, bool, object]] = []

        async def write(line: str) -> None:
            seen.append((json.loads(line), 1 in channel.requests, harness.sessions["s"].busy))
        channel = Channel("one", write)
        _own(harness, channel, "s")
        await harness.handle(channel, '{"op":"generate","id":1,"prompt":"x","session":"s"}')
        await asyncio.gather(*harness.tasks)
        assert seen == [({"id": 1, "error": "the model failed to load: no such model"}, False, None)]
    asyncio.run(main())
