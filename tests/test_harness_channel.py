"""The harness's channel never goes silent: an answer that cannot be encoded or written costs that one line."""

from __future__ import annotations

import asyncio
import json

import pytest

from pocketllm.harness.protocol import ProtocolError, parse_line
from pocketllm.harness.service import Channel

LONE = json.loads('"\\ud800"')


class Writer:
    """Collects written lines; ``fail`` holds exceptions to raise on the next writes, in order."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.fail: list[BaseException] = []

    async def __call__(self, line: str) -> None:
        if self.fail:
            raise self.fail.pop(0)
        line.encode("utf-8")   # what reaches the wire is always UTF-8
        self.lines.append(json.loads(line))


def _sent(*objs: dict, fail: list[BaseException] | None = None) -> tuple[Channel, Writer]:
    writer = Writer()
    writer.fail = list(fail or [])
    channel = Channel("test", writer)

    async def main() -> None:
        for obj in objs:
            await channel.send(obj)
    asyncio.run(main())
    return channel, writer


def test_an_id_with_a_lone_surrogate_is_answered_escaped() -> None:
    channel, writer = _sent({"id": LONE, "state": "ready"}, {"id": 2, "state": "ready"})
    assert writer.lines == [{"id": LONE, "state": "ready"}, {"id": 2, "state": "ready"}]
    assert not channel.closed


@pytest.mark.parametrize("bad", [object(), float("nan"), b"bytes"])
def test_an_unencodable_answer_becomes_an_error_for_its_id(bad) -> None:
    channel, writer = _sent({"id": 5, "chunk": bad}, {"id": 6, "done": True})
    assert writer.lines[0]["id"] == 5 and "could not be encoded" in writer.lines[0]["error"]
    assert writer.lines[1] == {"id": 6, "done": True} and not channel.closed


def test_a_write_failure_is_survived_unless_the_peer_is_gone() -> None:
    channel, writer = _sent({"id": 1}, {"id": 2}, fail=[OSError(5, "Input/output error")])
    assert writer.lines == [{"id": 2}] and not channel.closed
    channel, writer = _sent({"id": 1}, {"id": 2}, fail=[BrokenPipeError()])
    assert writer.lines == [] and channel.closed


def test_lone_surrogates_in_text_fields_are_refused_by_name() -> None:
    for line, field in [('{"op":"generate","id":1,"prompt":"a\\ud800"}', "prompt"),
                        ('{"op":"chat","id":2,"messages":[{"role":"user","content":"\\udfff"}]}', "content"),
                        ('{"op":"generate","id":3,"prompt":"a","stop":["\\ud800"]}', "stop")]:
        with pytest.raises(ProtocolError) as info:
            parse_line(line)
        assert field in info.value.message and "not valid Unicode" in info.value.message
        assert info.value.request_id is not None
