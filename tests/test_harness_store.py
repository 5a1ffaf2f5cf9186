"""The ``--kv-store`` files: written atomically and privately; a corrupt conversation is refused and kept aside,
never overwritten; a corrupt KV increment costs a cold prefill from the intact prefix, not the turn."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import stat

import pytest

from pocketllm.config import EngineArgs
from pocketllm.harness.service import Channel, Harness
from pocketllm.harness.sessions import SessionStore, StoreError

RECORD = {"version": 1, "session": "s1", "kind": "chat",
          "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
          "text": "", "token_ids": [1, 2, 3]}


def _files(directory) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(directory), "*")))


def test_the_record_is_written_atomically_and_privately(tmp_path) -> None:
    store = SessionStore(str(tmp_path / "store"))
    store.save("s1", RECORD, None)
    path = tmp_path / "store" / "s1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.load("s1") == RECORD and _files(tmp_path / "store") == ["s1.json"]
    with pytest.raises(TypeError):   # a write that fails half way leaves the previous record whole
        store.save("s1", {**RECORD, "text": object()}, None)
    assert store.load("s1") == RECORD and _files(tmp_path / "store") == ["s1.json"]


@pytest.mark.parametrize("content", [
    json.dumps(RECORD)[:40].encode(),                                    # truncated
    b"\x00\xff garbage \x81",                                            # not UTF-8
    b"",                                                                 # empty
    json.dumps({**RECORD, "token_ids": ["a"]}).encode(),                 # the wrong shape
    json.dumps({**RECORD, "messages": [{"role": "robot", "content": 1}]}).encode(),
    json.dumps({**RECORD, "session": "other"}).encode(),
    json.dumps({**RECORD, "version": "1"}).encode(),
])
def test_a_corrupt_record_is_refused_and_moved_aside(tmp_path, content: bytes) -> None:
    store = SessionStore(str(tmp_path))
    (tmp_path / "s1.json").write_bytes(content)
    with pytest.raises(StoreError, match="corrupt .* moved aside to s1.json.corrupt-"):
        store.load("s1")
    files = _files(tmp_path)
    assert len(files) == 1 and files[0].startswith("s1.json.corrupt-")
    assert (tmp_path / files[0]).read_bytes() == content   # kept as it was
    assert store.load("s1") is None                          # the name starts anew


def test_a_record_of_a_newer_format_is_refused_and_left_alone(tmp_path) -> None:
    store = SessionStore(str(tmp_path))
    content = json.dumps({**RECORD, "version": 2})
    (tmp_path / "s1.json").write_text(content)
    with pytest.raises(StoreError, match="newer"):
        store.load("s1")
    assert _files(tmp_path) == ["s1.json"] and (tmp_path / "s1.json").read_text() == content


class Lines:
    """A channel's written lines, parsed."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    async def __call__(self, line: str) -> None:
        self.lines.append(json.loads(line))


def test_opening_a_corrupt_session_is_one_clear_error_and_the_file_is_never_overwritten(tmp_path) -> None:
    (tmp_path / "s1.json").write_text('{"version": 1, "session": "s1", "messa')

    async def main() -> list[dict]:
        harness = Harness(EngineArgs(model=str(tmp_path / "no-model")), store=SessionStore(str(tmp_path)))
        lines = Lines()
        channel = Channel("test", lines)
        await harness.handle(channel, '{"op": "open", "id": 1, "session": "s1"}')
        await harness.handle(channel, '{"op": "open", "id": 2, "session": "s1"}')
        return lines.lines

    refused, reopened = asyncio.run(main())
    assert set(refused) == {"id", "error"} and refused["id"] == 1
    assert "corrupt" in refused["error"] and "moved aside" in refused["error"]
    assert reopened == {"id": 2, "session": "s1", "resumed": False}
    aside = [f for f in _files(tmp_path) if f.startswith("s1.json.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == '{"version": 1, "session": "s1", "messa'


def test_a_corrupt_kv_increment_resumes_cold_from_the_intact_prefix(tmp_path, tiny_checkpoint) -> None:
    """Two stored increments (tokens 0-47 and 48-), the second one truncated: the session resumes with its
    history, the next turn restores the first increment, computes the rest, and its save rewrites the second."""
    from pocketllm import SamplingParams
    from pocketllm.api import LLM
    from pocketllm.harness.sessions import Session

    model = tiny_checkpoint("llama")
    args = EngineArgs(model=model, max_model_len=256, num_kv_blocks=64)
    store = SessionStore(str(tmp_path))
    text = " ".join(f"word{i}" for i in range(40))
    with LLM(model=model, max_model_len=256, num_kv_blocks=64) as llm:
        tokens = llm.tokenizer.encode(text, add_special_tokens=True)
        assert len(tokens) > 64
        llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1))
        session = Session("s1")
        record = {"version": 1, "session": "s1", "kind": "text", "messages": [], "text": text, "token_ids": tokens}
        for upto in (50, len(tokens)):   # two turns' saves, as the harness writes them
            start = session.kv_increment_start(tokens[:upto])
            increment = llm.export_prefix(tokens[:upto], start)
            store.save("s1", {**record, "token_ids": tokens[:upto]}, increment)
            session.kv_stored(start, increment)
    assert store.kv_parts("s1") == [0, 48]
    damaged = tmp_path / "s1.kv.48.safetensors"
    with open(damaged, "r+b") as handle:
        handle.truncate(damaged.stat().st_size // 2)

    async def resume() -> list[dict]:
        harness = Harness(args, store=SessionStore(str(tmp_path)))
        lines = Lines()
        channel = Channel("test", lines)
        await harness.load()
        try:
            await harness.handle(channel, '{"op": "open", "id": "o", "session": "s1"}')
            await harness.handle(channel, json.dumps({"op": "generate", "id": 1, "session": "s1",
                                                      "prompt": " and more", "n": 2, "temp": 0, "diag": True}))
            while harness.tasks:   # the turn, then its save
                await asyncio.wait(set(harness.tasks))
        finally:
            await harness.close()
        return lines.lines

    lines = asyncio.run(resume())
    opened = next(line for line in lines if line.get("id") == "o")
    assert opened["resumed"] is True and opened["text"] == text   # the history is intact
    done = next(line for line in lines if line.get("id") == 1 and ("done" in line or "error" in line))
    assert done.get("done"), done
    assert done["diag"]["kv_store"]["restored_tokens"] == 48       # the intact first increment
    assert done["diag"]["prefill"]["cached_tokens"] == 48          # the rest prefilled cold
    assert store.load("s1")["text"].startswith(text + " and more")
    joined, parts = store.load_kv("s1")                            # the save rewrote the damaged increment
    assert parts == [0, 48] and joined.token_ids == store.load("s1")["token_ids"][:joined.num_tokens]


def test_temporaries_of_interrupted_writes_are_removed_at_start(tmp_path) -> None:
    """A write killed between writing and renaming leaves ``<file>.tmp-<pid>-<thread>``: the store removes those
    of processes that are gone and keeps a live writer's."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    (tmp_path / f"s1.json.tmp-{dead_pid}-7").write_text("{")
    (tmp_path / f"s1.kv.0.safetensors.tmp-{dead_pid}-7").write_bytes(b"\0")
    live = tmp_path / f"s2.json.tmp-{os.getpid()}-7"
    live.write_text("{")
    SessionStore(str(tmp_path))
    assert _files(tmp_path) == [live.name]
