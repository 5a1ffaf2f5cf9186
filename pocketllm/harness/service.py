"""The harness: one loaded model serving protocol lines from channels (the stdio pipe or host connections).

Both faces (``pipe`` and ``host``) hand every line they read to ``Harness.handle`` with the ``Channel`` it
came from; answers go back through the channel. Requests run as asyncio tasks over ``AsyncLLM``, so the
conversations of every channel share the engine's continuous batching.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pocketllm.api import AsyncLLM
from pocketllm.config import EngineArgs
from pocketllm.errors import PocketLLMError
from pocketllm.harness.protocol import Op, ProtocolError, encode, error_line, finish_of, parse_line
from pocketllm.harness.sessions import Session, SessionStore
from pocketllm.sampling_params import SamplingParams

logger = logging.getLogger("pocketllm.harness")

# Used when neither the request nor the checkpoint's generation_config sets them (llama.cpp's defaults).
FALLBACK_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.0}
_GENERATION_CONFIG_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")
_FIELD_NAMES = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "repeat_penalty": "repetition_penalty",
                "seed": "seed", "stop": "stop"}


def _default_model_label() -> str:
    from pocketllm.loaders.default_model import default_model_path

    try:
        return default_model_path()
    except PocketLLMError:
        return "default"


class Channel:
    """Where lines come from and answers go: the pipe, or one WebSocket connection.

    ``write`` takes one encoded line; an exception of ``gone`` (or a ``ConnectionError``/``EOFError``) from it
    means the peer went away and the channel closes. Any other failure costs that one line only: an answer
    that cannot be encoded is replaced by an error line for its id, and a write that fails otherwise is
    logged; the channel keeps answering."""

    def __init__(self, name: str, write: Callable[[str], Awaitable[None]],
                 check_token: Callable[[str], bool] | None = None,
                 on_bad_token: Callable[[], None] | None = None,
                 gone: tuple[type[BaseException], ...] = ()) -> None:
        self.name = name
        self._write = write
        self._gone = (ConnectionError, EOFError, *gone)
        self.check_token = check_token
        self.on_bad_token = on_bad_token
        self.requests: dict[Any, Turn] = {}
        self.sessions: set[str] = set()
        self.closed = False

    def _encoded(self, obj: dict[str, Any]) -> str:
        try:
            return encode(obj)
        except (TypeError, ValueError, RecursionError) as exc:
            logger.warning("channel %s: an answer could not be encoded (%s); sent an error instead", self.name, exc)
            request_id = obj.get("id")
            try:
                encode({"id": request_id})
            except (TypeError, ValueError, RecursionError):
                request_id = None
            return encode(error_line(f"internal error: the answer could not be encoded ({type(exc).__name__})",
                                     request_id))

    async def send(self, obj: dict[str, Any]) -> None:
        if self.closed:
            return
        line = self._encoded(obj)
        try:
            await self._write(line)
        except self._gone as exc:   # the peer went away; the host's reader notices and detaches us
            logger.debug("channel %s: the peer is gone (%r)", self.name, exc)
            self.closed = True
        except Exception as exc:
            logger.warning("channel %s: an answer could not be written (%r); carrying on", self.name, exc)


@dataclass
class Turn:
    """A generate/chat request in flight."""

    id: Any
    engine_id: str
    session: Session | None
    cancelled: bool = False
    submitted: bool = False


class Harness:
    """The resident model and the protocol's operations over it."""

    def __init__(self, engine_args: EngineArgs, *, store: SessionStore | None = None,
                 idle_expiry_s: float | None = None, on_shutdown: Callable[[], None] | None = None) -> None:
        self.engine_args = engine_args
        self.store = store
        self.idle_expiry_s = idle_expiry_s
        self.on_shutdown = on_shutdown
        self.model_label = engine_args.model or _default_model_label()
        self.llm: AsyncLLM | None = None
        self.load_error: BaseException | None = None
        self.ready = asyncio.Event()
        self.sessions: dict[str, Session] = {}
        self.tasks: set[asyncio.Task] = set()
        self._notices: set[asyncio.Task] = set()
        self.draining = False
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:6]
        self._reaper: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    async def load(self) -> None:
        """Load the model in a worker thread; health says ``loading`` until it is done."""
        if self.idle_expiry_s and self._reaper is None:
            self._reaper = asyncio.create_task(self._expire_idle())
        try:
            self.llm = await asyncio.to_thread(AsyncLLM, self.engine_args)
            self.model_label = self.llm.model_path
            logger.info("model ready: %s", self.model_label)
        except BaseException as exc:
            self.load_error = exc
            raise
        finally:
            self.ready.set()

    @property
    def state(self) -> str:
        if self.llm is not None:
            return "ready"
        return "failed" if self.load_error is not None else "loading"

    def begin_shutdown(self) -> None:
        """Stop taking new requests; what runs finishes (``drain``)."""
        if not self.draining:
            self.draining = True
            logger.info("draining: %d request(s) in flight", len(self.tasks))
            if self.on_shutdown is not None:
                self.on_shutdown()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for running requests and session saves; after ``timeout`` s cancel what still runs."""
        self.draining = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.tasks:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                logger.warning("drain timeout: cancelling %d request(s)", len(self.tasks))
                self.cancel_all()
                deadline = None
                continue
            await asyncio.wait(set(self.tasks), timeout=left)

    def cancel_all(self) -> None:
        """End every running request as cancelled (sessions stay, with the partial answers)."""
        for task in list(self.tasks):
            turn = getattr(task, "turn", None)
            if turn is not None:
                self._cancel_turn(turn)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.llm is not None:
            await self.llm.shutdown()

    def _spawn(self, coro, turn: Turn | None = None) -> asyncio.Task:
        task = asyncio.create_task(coro)
        task.turn = turn  # type: ignore[attr-defined]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _notify(self, channel: Channel, notice: dict[str, Any]) -> None:
        """Send an untagged notice without waiting for the write: a client that does not read its connection
        holds up no other client (a host's send waits while the peer's buffer is full)."""
        task = asyncio.create_task(channel.send(notice))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    # --- lines ------------------------------------------------------------------------------------
    async def handle(self, channel: Channel, line: str | bytes) -> None:
        """Serve one line; never raises for anything the line contains. A line carrying the id of a request still
        running on the channel is refused, unless it is that request's ``cancel``."""
        try:
            op = parse_line(line)
        except ProtocolError as exc:
            await self._refuse(channel, exc.message, exc.request_id)
            return
        try:
            if op.op != "cancel" and op.id in channel.requests:
                raise ProtocolError(f"{op.op} refused: send it with another id")
            await getattr(self, f"_op_{op.op}")(channel, op)
        except ProtocolError as exc:
            await self._refuse(channel, exc.message, op.id)
        except PocketLLMError as exc:
            await self._refuse(channel, str(exc), op.id)
        except Exception as exc:
            logger.exception("op %s failed", op.op)
            await self._refuse(channel, f"internal error: {exc!r}", op.id)

    @staticmethod
    async def _refuse(channel: Channel, message: str, request_id: Any) -> None:
        """The error line answering a line just read: tagged with the line's id, unless a request still running
        holds that id. Then it is untagged and names the id, so that it cannot be taken for that request's end."""
        if request_id is not None and request_id in channel.requests:
            message = f"{message} (the line's id {request_id!r} belongs to a request still running)"
            request_id = None
        await channel.send(error_line(message, request_id))

    async def _op_health(self, channel: Channel, op: Op) -> None:
        await channel.send({"id": op.id, "state": self.state, "model": self.model_label})

    async def _op_auth(self, channel: Channel, op: Op) -> None:
        if channel.check_token is None:
            raise ProtocolError("auth is for host connections; the pipe needs no token")
        if not channel.check_token(op.get("token")):
            await channel.send(error_line("wrong token", op.id))
            if channel.on_bad_token is not None:
                channel.on_bad_token()
            return
        await channel.send({"id": op.id, "auth": "ok"})

    async def _op_shutdown(self, channel: Channel, op: Op) -> None:
        await channel.send({"id": op.id, "state": "draining", "running": len(self.tasks)})
        self.begin_shutdown()

    async def _op_cancel(self, channel: Channel, op: Op) -> None:
        turn = channel.requests.get(op.id)
        if turn is None:
            raise ProtocolError(f"no running request with id {op.id!r}")
        self._cancel_turn(turn)

    def _cancel_turn(self, turn: Turn) -> None:
        turn.cancelled = True
        if turn.submitted and self.llm is not None:
            self.llm.cancel(turn.engine_id)

    # --- sessions ---------------------------------------------------------------------------------
    async def _op_open(self, channel: Channel, op: Op) -> None:
        sid = op.get("session") or secrets.token_hex(6)
        session = self.sessions.get(sid)
        resumed = session is not None
        stored_tokens = 0
        if session is None:
            session = Session(sid)
            record = self.store.load(sid) if self.store is not None else None   # StoreError: refused, kept
            if record is not None:
                session.restore(record)
                resumed = True
                if session.token_ids:
                    session.pending_kv = True
                    stored_tokens = len(session.token_ids)
            self.sessions[sid] = session
        elif session.owner is not None and session.owner is not channel:
            if session.busy is not None and not session.owner.closed:
                raise ProtocolError(f"session {sid!r} is busy with a request on another connection")
            previous = session.owner
            previous.sessions.discard(sid)
            self._notify(previous, {"id": None, "session": sid, "detached": "opened on another connection"})
        if "messages" in op.fields:
            if session.busy is not None:
                raise ProtocolError(f"session {sid!r} is busy with request {session.busy!r}")
            session.kind = "chat"
            session.messages = op.get("messages")
        session.owner = channel
        session.touch()
        channel.sessions.add(sid)
        reply: dict[str, Any] = {"id": op.id, "session": sid, "resumed": resumed}
        if session.kind == "chat":
            reply["messages"] = session.messages
        elif session.kind == "text":
            reply["text"] = session.text
        if stored_tokens:
            reply["stored_tokens"] = stored_tokens
        await channel.send(reply)

    async def _op_close(self, channel: Channel, op: Op) -> None:
        sid = op.get("session")
        session = self.sessions.get(sid)
        stored = self.store is not None and self.store.exists(sid)
        if session is None and not stored:
            raise ProtocolError(f"unknown session {sid!r}")
        if session is not None:
            if session.owner is not None and session.owner is not channel and not session.owner.closed:
                raise ProtocolError(f"session {sid!r} is open on another connection")
            session.closed = True
            for turn in channel.requests.values():
                if turn.session is session:
                    self._cancel_turn(turn)
            self.sessions.pop(sid, None)
            channel.sessions.discard(sid)
        if self.store is not None:
            if session is not None:
                async with session.save_lock:   # a save already under way finishes (or sees closed) first
                    self.store.delete(sid)
            else:
                self.store.delete(sid)
        await channel.send({"id": op.id, "session": sid, "closed": True})

    def detach(self, channel: Channel) -> None:
        """The channel is gone: its requests are cancelled, its sessions wait to be resumed (or expire)."""
        channel.closed = True
        for turn in list(channel.requests.values()):
            self._cancel_turn(turn)
        for sid in channel.sessions:
            session = self.sessions.get(sid)
            if session is not None and session.owner is channel:
                session.owner = None
                session.touch()
        channel.sessions.clear()

    async def _expire_idle(self) -> None:
        period = max(0.05, min(1.0, self.idle_expiry_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for sid, session in list(self.sessions.items()):
                if session.busy is None and now - session.last_active > self.idle_expiry_s:
                    logger.info("session %s expired after %.1f s idle", sid, now - session.last_active)
                    del self.sessions[sid]
                    owner = session.owner
                    if owner is not None:
                        owner.sessions.discard(sid)
                        self._notify(owner, {"id": None, "session": sid, "expired": True})

    # --- generation -------------------------------------------------------------------------------
    async def _op_generate(self, channel: Channel, op: Op) -> None:
        await self._start(channel, op, "text")

    async def _op_chat(self, channel: Channel, op: Op) -> None:
        await self._start(channel, op, "chat")

    async def _start(self, channel: Channel, op: Op, kind: str) -> None:
        if self.draining:
            raise ProtocolError("the harness is shutting down and takes no new requests")
        session = None
        sid = op.get("session")
        if sid is not None:
            session = self.sessions.get(sid)
            if session is None or session.owner is not channel:
                raise ProtocolError(f"session {sid!r} is not open on this connection; send open first")
            if session.busy is not None:
                raise ProtocolError(f"session {sid!r} is busy with request {session.busy!r}")
            if session.kind not in (None, kind):
                want = "chat" if session.kind == "chat" else "generate"
                raise ProtocolError(f"session {sid!r} holds a {session.kind} conversation; use {want}")
            session.busy = op.id
            session.touch()
        turn = Turn(op.id, f"h{self._prefix}-{next(self._ids)}", session)
        channel.requests[op.id] = turn
        self._spawn(self._run_turn(channel, op, turn, kind), turn)

    def _prompt(self, op: Op, session: Session | None, kind: str) -> tuple[list[int], Any]:
        """(prompt token ids, the session's new state) of this turn (run in a worker thread: a long prompt
        holds no other conversation up; one certainly past the context is refused before it is encoded)."""
        llm = self.llm
        tokenizer = llm.tokenizer
        if tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so text cannot be encoded for it")
        if kind == "text":
            text = (session.text if session else "") + op.get("prompt")
            self._check_fits(tokenizer.min_tokens(text), "at least ")
            return tokenizer.encode(text, add_special_tokens=True), text
        messages = (list(session.messages) if session else []) + op.get("messages")
        rendered = llm.render_chat(messages)  # refuses a model without a chat template
        self._check_fits(tokenizer.min_tokens(rendered), "at least ")
        return tokenizer.encode(rendered, add_special_tokens=False), messages

    def _check_fits(self, prompt_len: int, bound: str = "") -> None:
        """Refuses a prompt of ``prompt_len`` tokens (``bound``: "at least " for a lower bound) that leaves no
        room in the context."""
        limit = self.llm.max_model_len
        if limit - prompt_len < 1:
            raise ProtocolError(f"the prompt is {bound}{prompt_len} tokens and the context is {limit} (--ctx); "
                                "shorten it or start a new session")

    def _params(self, op: Op, prompt_len: int) -> SamplingParams:
        self._check_fits(prompt_len)
        room = self.llm.max_model_len - prompt_len
        values: dict[str, Any] = dict(FALLBACK_SAMPLING)
        defaults = self.llm.generation_config
        values.update({name: defaults[name] for name in _GENERATION_CONFIG_FIELDS if defaults.get(name) is not None})
        if defaults.get("do_sample") is False:   # the checkpoint asks for greedy decoding
            values["temperature"] = 0.0
        for name, target in _FIELD_NAMES.items():
            if name in op.fields:
                values[target] = op.fields[name]
        n = op.get("n", -1)
        values["max_tokens"] = room if n == -1 else min(n, room)
        return SamplingParams(**values)

    async def _restore_kv(self, session: Session) -> None:
        session.pending_kv = False
        try:
            snapshot, parts = await asyncio.to_thread(self.store.load_kv, session.sid)
            session.restored_tokens = await self.llm.import_prefix(snapshot) if snapshot is not None else 0
            if snapshot is not None:
                session.stored_tokens, session.stored_parts = list(snapshot.token_ids), parts
            logger.info("session %s: %d stored tokens back in the prefix cache", session.sid,
                        session.restored_tokens)
        except Exception as exc:   # whatever the files hold, the turn goes on cold with the history intact
            logger.warning("session %s: stored KV not used: %s", session.sid, exc)
            session.restored_tokens = 0

    async def _run_turn(self, channel: Channel, op: Op, turn: Turn, kind: str) -> None:
        session = turn.session
        last: dict[str, Any] | None = None   # the done or error line, sent once the id and the session are free
        try:
            await self.ready.wait()
            if self.llm is None:
                raise ProtocolError(f"the model failed to load: {self.load_error}")
            if turn.cancelled:
                last = {"id": op.id, "done": True, "finish": "cancel",
                        "usage": {"prompt_tokens": 0, "gen_tokens": 0, "prefill_ms": 0.0, "decode_ms": 0.0}}
                return
            prompt_ids, new_state = await asyncio.to_thread(self._prompt, op, session, kind)
            params = self._params(op, len(prompt_ids))
            restored = None
            if session is not None and session.pending_kv:
                await self._restore_kv(session)
                restored = session.restored_tokens
            turn.submitted = True
            output = None
            async for event in self.llm.generate_stream(prompt_ids, params, request_id=turn.engine_id):
                if turn.cancelled:
                    self.llm.cancel(turn.engine_id)
                if event.text:
                    await channel.send({"id": op.id, "chunk": event.text})
                if event.finished:
                    output = event.output
            last = self._done(op, output, restored)
            if session is not None and not session.closed:
                self._advance(session, kind, new_state, prompt_ids, output)
                if self.store is not None:
                    self._spawn(self._save(session, session.record()))
        except (ProtocolError, PocketLLMError) as exc:
            last = error_line(getattr(exc, "message", None) or str(exc), op.id)
        except Exception as exc:
            logger.exception("request %r failed", op.id)
            last = error_line(f"internal error: {exc!r}", op.id)
        finally:
            channel.requests.pop(op.id, None)
            if session is not None:
                session.busy = None
                session.touch()
            if last is not None:
                await channel.send(last)

    @staticmethod
    def _advance(session: Session, kind: str, new_state: Any, prompt_ids: list[int], output) -> None:
        session.kind = kind
        if kind == "text":
            session.text = new_state + output.text
        else:
            session.messages = new_state + [{"role": "assistant", "content": output.text}]
        session.token_ids = list(prompt_ids) + list(output.token_ids)

    def _done(self, op: Op, output, restored: int | None) -> dict[str, Any]:
        usage = output.usage
        done: dict[str, Any] = {
            "id": op.id, "done": True, "finish": finish_of(output.finish_reason, output.stop_reason),
            "usage": {"prompt_tokens": usage.prompt_tokens, "gen_tokens": usage.completion_tokens,
                      "prefill_ms": round(usage.prefill_time_s * 1000, 3),
                      "decode_ms": round(usage.decode_time_s * 1000, 3)}}
        if op.get("diag"):
            done["diag"] = self._diag(usage, restored, op.get("session"))
        return done

    def _diag(self, usage, restored: int | None, sid: str | None) -> dict[str, Any]:
        details = self.llm.engine_caps().details
        computed = usage.prompt_tokens - usage.cached_tokens
        diag: dict[str, Any] = {
            "route": {"backend": details.get("backend", "torch"), "device": details.get("device"),
                      "dtype": details.get("dtype"), "architecture": details.get("architecture"),
                      "format": details.get("format")},
            "prefill": {"mode": "prefix-cached" if usage.cached_tokens else "cold",
                        "chunked": computed > self.engine_args.max_num_batched_tokens
                        and self.engine_args.enable_chunked_prefill,
                        "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                        "computed_tokens": computed},
            "prefix_cache": {"hit_tokens": usage.cached_tokens,
                             "hit_rate": round(usage.cached_tokens / max(1, usage.prompt_tokens), 4)},
            "queue_ms": round(usage.queue_time_s * 1000, 3),
        }
        if sid is not None:
            diag["session"] = sid
        if restored is not None:
            diag["kv_store"] = {"restored_tokens": restored}
        return diag

    async def _save(self, session: Session, record: dict[str, Any]) -> None:
        """Persist the conversation and the KV of its tokens (runs after the turn's done line; one save of a
        session at a time, in turn order)."""
        try:
            async with session.save_lock:
                start = session.kv_increment_start(record["token_ids"])
                increment = None
                if record["token_ids"]:
                    try:
                        increment = await self.llm.export_prefix(record["token_ids"], start)
                    except PocketLLMError as exc:   # e.g. no prefix cache: the conversation is kept, cold
                        logger.warning("session %s: KV not stored: %s", session.sid, exc)
                if session.closed:
                    return
                await asyncio.to_thread(self.store.save, session.sid, record, increment)
                session.kv_stored(start, increment)
            logger.debug("session %s saved (%d KV tokens, %d new)", session.sid, len(session.stored_tokens),
                         increment.num_tokens if increment else 0)
        except Exception:
            logger.exception("saving session %s failed", session.sid)
            session.kv_stored(0, None)   # what is on disk is unknown now: the next save rewrites it whole
