"""Sessions (one conversation each) and the ``--kv-store`` directory that keeps them across host restarts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pocketllm.api import KVSnapshot

logger = logging.getLogger("pocketllm.harness")

RECORD_VERSION = 1


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
    pending_kv: str | None = None      # stored KV file to import before the next turn
    restored_tokens: int | None = None  # set by that import, reported in the next turn's diag
    save_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def touch(self) -> None:
        self.last_active = time.monotonic()

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
    """``DIR/<session>.json`` (the conversation) and ``DIR/<session>.kv.safetensors`` (its KV blocks)."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def _json(self, sid: str) -> str:
        return os.path.join(self.directory, f"{sid}.json")

    def kv_file(self, sid: str) -> str:
        return os.path.join(self.directory, f"{sid}.kv.safetensors")

    def load(self, sid: str) -> dict[str, Any] | None:
        """The stored record of ``sid``, or None (also when the file cannot be read)."""
        path = self._json(sid)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError) as exc:
            logger.warning("cannot read stored session %s: %s", sid, exc)
            return None
        if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
            logger.warning("stored session %s has an unknown format; ignoring it", sid)
            return None
        return record

    def save(self, sid: str, record: dict[str, Any], snapshot: KVSnapshot | None) -> None:
        """Write the KV (when given) and then the record, each atomically."""
        if snapshot is not None and snapshot.num_tokens:
            snapshot.save(self.kv_file(sid))
        elif os.path.exists(self.kv_file(sid)):
            os.remove(self.kv_file(sid))
        path = self._json(sid)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(record, handle, ensure_ascii=False)
        os.replace(tmp, path)

    def delete(self, sid: str) -> None:
        for path in (self._json(sid), self.kv_file(sid)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
