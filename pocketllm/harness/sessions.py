"""Sessions (one conversation each) and the ``--kv-store`` directory that keeps them across host restarts."""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pocketllm.api import KVSnapshot
from pocketllm.errors import PocketLLMError
from pocketllm.harness.protocol import check_messages

logger = logging.getLogger("pocketllm.harness")

RECORD_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700


class StoreError(PocketLLMError):
    """A stored session that cannot be used (unreadable, corrupt or of an unknown format); it is never
    overwritten: a corrupt file is moved aside first."""


def check_record(record: Any, sid: str) -> dict[str, Any]:
    """``record`` if it is a whole session record of ``sid``; raises ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if record.get("session") != sid:
        raise ValueError(f"it names session {record.get('session')!r}")
    if record.get("kind") not in ("chat", "text", None):
        raise ValueError(f"unknown kind {record.get('kind')!r}")
    messages = record.get("messages", [])
    if messages:
        check_messages(messages)
    elif not isinstance(messages, list):
        raise ValueError("messages is not a list")
    if not isinstance(record.get("text", ""), str):
        raise ValueError("text is not a string")
    tokens = record.get("token_ids", [])
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise ValueError("token_ids is not a list of token ids")
    return record


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(temporary path)``, then the file is made private (0600), synced and renamed over ``path``: a
    reader sees the old file or the whole new one, never a part, also after a crash."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    directory = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(directory)   # the rename itself survives a crash
    finally:
        os.close(directory)


def _write_json(record: dict[str, Any]) -> Callable[[str], None]:
    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle, ensure_ascii=False)
    return write


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


@dataclass
class Session:
    """One conversation: chat ``messages`` or a growing ``text`` (the kind is fixed by its first turn).

    ``token_ids`` are the prompt and answer tokens of its last turn: the prefix its KV blocks hold.
    """

    sid: str
    kind: str | None = None            # "chat" | "text" | None (no turn yet)
    messages: list[dict[str, str]] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    owner: Any = None                  # the Channel it is open on, None while detached
    busy: Any = None                   # id of the request running in it
    last_active: float = field(default_factory=time.monotonic)
    closed: bool = False
    pending_kv: bool = False           # stored KV to import before the next turn
    restored_tokens: int | None = None  # set by that import, reported in the next turn's diag
    # The KV on disk: the tokens it holds (from token 0) and the first token of each stored increment.
    stored_tokens: list[int] = field(default_factory=list)
    stored_parts: list[int] = field(default_factory=list)
    save_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def kv_increment_start(self, token_ids: list[int]) -> int:
        """Where this turn's KV increment starts: the end of the stored KV while the conversation still begins
        with it, else the start of the stored increment in which they part (that one is rewritten)."""
        common = 0
        for stored, new in zip(self.stored_tokens, token_ids):
            if stored != new:
                break
            common += 1
        if common == len(self.stored_tokens):
            return common
        return max((start for start in self.stored_parts if start <= common), default=0)

    def kv_stored(self, start: int, increment: KVSnapshot | None) -> None:
        """Record what the store now holds after writing ``increment`` at ``start`` (None: no KV kept)."""
        if increment is None:
            self.stored_tokens, self.stored_parts = [], []
            return
        self.stored_tokens = self.stored_tokens[:start] + list(increment.token_ids)
        self.stored_parts = [p for p in self.stored_parts if p < start] + ([start] if increment.token_ids else [])

    def record(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "session": self.sid, "kind": self.kind,
                "messages": [dict(m) for m in self.messages], "text": self.text, "token_ids": list(self.token_ids)}

    def restore(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        self.kind = kind if kind in ("chat", "text") else None
        self.messages = [dict(m) for m in record.get("messages") or []]
        self.text = record.get("text") or ""
        self.token_ids = [int(t) for t in record.get("token_ids") or []]


class SessionStore:
    """``DIR/<session>.json`` (the conversation) and ``DIR/<session>.kv.<first token>.safetensors`` (its KV
    blocks, one increment per turn that added blocks: a turn writes only its new blocks)."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        self._remove_orphan_temporaries()

    def _remove_orphan_temporaries(self) -> None:
        """Delete the temporary files of writes whose process is gone (``write_atomically`` names them
        ``<file>.tmp-<pid>-<thread>``; a crash between writing and renaming leaves one behind)."""
        for path in glob.glob(os.path.join(glob.escape(self.directory), "*.tmp-*-*")):
            pid = os.path.basename(path).rsplit(".tmp-", 1)[1].split("-", 1)[0]
            if not pid.isdigit() or _process_alive(int(pid)):
                continue
            logger.info("removing %s, left by an interrupted write", os.path.basename(path))
            self._remove(path)

    def _json(self, sid: str) -> str:
        return os.path.join(self.directory, f"{sid}.json")

    def _kv_part(self, sid: str, first_token: int) -> str:
        return os.path.join(self.directory, f"{sid}.kv.{first_token}.safetensors")

    def _legacy_kv(self, sid: str) -> str:
        """The single KV file of earlier versions (not read: such a session resumes cold; removed on save)."""
        return os.path.join(self.directory, f"{sid}.kv.safetensors")

    def kv_parts(self, sid: str) -> list[int]:
        """First tokens of the stored KV increments of ``sid``, ascending."""
        prefix, suffix = f"{sid}.kv.", ".safetensors"
        starts = []
        for path in glob.glob(os.path.join(glob.escape(self.directory), f"{glob.escape(prefix)}*{suffix}")):
            middle = os.path.basename(path)[len(prefix):-len(suffix)]
            if middle.isdigit():
                starts.append(int(middle))
        return sorted(starts)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def load_kv(self, sid: str) -> tuple[KVSnapshot | None, list[int]]:
        """The stored KV of ``sid`` joined from token 0, stopping at a gap or at an increment that cannot be
        read (logged: the turn prefills the rest cold, and its save rewrites from there), and the first tokens
        of the increments used."""
        parts: list[KVSnapshot] = []
        for start in self.kv_parts(sid):
            if start != (parts[-1].end_token if parts else 0):
                break
            try:
                part = KVSnapshot.load(self._kv_part(sid, start))
            except Exception as exc:   # a truncated or garbage file: safetensors, torch or JSON errors alike
                logger.warning("session %s: stored KV from token %d is unreadable (%s); the turn prefills from "
                               "token %d", sid, start, exc, start)
                break
            if part.first_token != start:
                break
            parts.append(part)
        if not parts:
            return None, []
        return KVSnapshot.join(parts), [p.first_token for p in parts]

    def exists(self, sid: str) -> bool:
        return os.path.isfile(self._json(sid))

    def _move_aside(self, path: str) -> str:
        """Rename a corrupt file to ``<name>.corrupt-<time>`` (kept for inspection, never overwritten)."""
        aside = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        candidate, n = aside, 1
        while os.path.exists(candidate):
            candidate, n = f"{aside}-{n}", n + 1
        os.replace(path, candidate)
        return candidate

    def load(self, sid: str) -> dict[str, Any] | None:
        """The stored record of ``sid``, or None when there is none. A file that cannot be used raises
        ``StoreError``: a corrupt one is moved aside first (so a new conversation never overwrites it)."""
        path = self._json(sid)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"the stored conversation of session {sid!r} cannot be read: "
                             f"{exc.strerror or exc}") from None
        try:
            record = json.loads(data.decode("utf-8"))
            version = record.get("version") if isinstance(record, dict) else None
            if isinstance(version, int) and version > RECORD_VERSION:
                raise StoreError(f"the stored conversation of session {sid!r} was written by a newer PocketLLM "
                                 f"(format {version}); it is left as it is")
            if version != RECORD_VERSION:
                raise ValueError(f"unknown format {version!r}")
            return check_record(record, sid)
        except (ValueError, RecursionError) as exc:   # UnicodeDecodeError and JSONDecodeError included
            aside = self._move_aside(path)
            logger.error("session %s: the stored conversation is corrupt (%s); moved aside to %s", sid, exc, aside)
            raise StoreError(f"the stored conversation of session {sid!r} is corrupt ({exc}); it was moved "
                             f"aside to {os.path.basename(aside)}, and opening {sid!r} again starts it "
                             "anew") from None

    def save(self, sid: str, record: dict[str, Any], increment: KVSnapshot | None) -> None:
        """Write the KV increment (increments from its first token on are replaced; None drops all stored KV)
        and then the record, each atomically."""
        start = increment.first_token if increment is not None else 0
        for first in self.kv_parts(sid):
            if first >= start:
                self._remove(self._kv_part(sid, first))
        self._remove(self._legacy_kv(sid))
        if increment is not None and increment.token_ids:
            write_atomically(self._kv_part(sid, start), increment.save)
        write_atomically(self._json(sid), _write_json(record))

    def delete(self, sid: str) -> None:
        for path in (self._json(sid), self._legacy_kv(sid), *(self._kv_part(sid, f) for f in self.kv_parts(sid))):
            self._remove(path)
