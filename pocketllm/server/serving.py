"""The serving layer behind both OpenAI endpoints: choices, deadlines, cancellation, response shaping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pocketllm.api import AsyncLLM
from pocketllm.errors import InvalidRequestError
from pocketllm.outputs import RequestOutput, TokenEvent, TokenLogprob
from pocketllm.protocol.chat_output import ChatOutputSpec
from pocketllm.protocol.openai_fields import ParsedRequest
from pocketllm.protocol.structured_output import is_forced_tool_choice, parse_forced_tool_calls
from pocketllm.protocol.tool_call_deltas import tool_call_deltas
from pocketllm.request_builder import EngineRequest
from pocketllm.sampling_params import SamplingParams
from pocketllm.server.metrics import ServerMetrics

SEED_STRIDE = 1_000_003


class RequestFailed(Exception):
    """A request that produced no choice at all: ``status`` is 504 on a deadline, else 500."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Choice:
    """One choice of a request: its own engine request, prompt and sampling parameters."""

    index: int
    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Streaming with log-probabilities: entries of tokens whose text has not been sent yet, how many entries
    # were sent, and the text offset the next completions entry starts at.
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_logprobs: int = 0
    sent_offset: int = 0
    # A forced tool call on a stream: the answer, held back until it parses as calls or is released as content.
    held: list[str] = field(default_factory=list)


@dataclass
class Job:
    """A request being served: its id, choices and when it started."""

    request_id: str
    endpoint: str
    choices: list[_Choice]
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    # How a chat answer is read back: reasoning split and the checkpoint's own tool-call syntax.
    chat_output: ChatOutputSpec | None = None
    # tool_choice "required" / a named function: the answer is a JSON list of calls, parsed into tool_calls.
    forced_tool_calls: bool = False
    # stream_options.include_usage: chunks carry "usage": null and a last chunk the usage of every choice.
    include_usage: bool = False
    finished: list[RequestOutput] = field(default_factory=list)
    # Why it was ended early (client_disconnect, cancel, deadline, shutdown); None while it runs its course.
    aborted: str | None = None


# Built once: json.dumps with a non-default option builds an encoder on every call (a streamed token's chunk).
_JSON_UTF8 = json.JSONEncoder(ensure_ascii=False)
_JSON_ASCII = json.JSONEncoder(ensure_ascii=True)


def sse(payload: dict | str) -> bytes:
    """One server-sent event, encoded; always valid UTF-8 (a lone surrogate in a payload is written escaped)."""
    if isinstance(payload, str):
        return b"data: " + payload.encode() + b"\n\n"
    try:
        data = _JSON_UTF8.encode(payload).encode("utf-8")
    except UnicodeEncodeError:
        data = _JSON_ASCII.encode(payload).encode("ascii")
    return b"data: " + data + b"\n\n"


def _coalesced(ready: list[tuple[_Choice, TokenEvent | Exception]]) -> list[tuple[_Choice, TokenEvent | Exception]]:
    """What arrived together, each choice's consecutive events joined into one where they can be
    (``TokenEvent.followed_by``): a reader that fell behind the engine sends one chunk for the tokens it has,
    not one chunk a token. A reader that keeps up has one event a choice and sends each as it comes."""
    joined: list[tuple[_Choice, TokenEvent | Exception]] = []
    last: dict[int, int] = {}   # choice index -> where its latest event sits in ``joined``
    for choice, event in ready:
        at = last.get(choice.index)
        if at is not None and isinstance(event, TokenEvent):
            earlier = joined[at][1]
            merged = earlier.followed_by(event) if isinstance(earlier, TokenEvent) else None
            if merged is not None:
                joined[at] = (choice, merged)
                continue
        last[choice.index] = len(joined)
        joined.append((choice, event))
    return joined


async def _arrived(ready: list) -> AsyncIterator[list]:
    yield ready


async def _one_choice(choice: _Choice, events: AsyncIterator[list[TokenEvent]]
                      ) -> AsyncIterator[list[tuple[_Choice, TokenEvent | Exception]]]:
    """One choice's event lists, each event with its choice; a failure as its exception, then the end."""
    try:
        async for batch in events:
            yield [(choice, event) for event in batch]
    except Exception as exc:   # reported to the client as an error event
        yield [(choice, exc)]
    finally:
        await events.aclose()


async def _merged(merged: asyncio.Queue, tasks: list[asyncio.Future]
                  ) -> AsyncIterator[list[tuple[_Choice, TokenEvent | Exception]]]:
    """The lists that the choices' tasks put in ``merged`` (None: a choice ended), what arrived together as
    one list, until every task has ended; the tasks are cancelled if the reader leaves early."""
    open_choices = len(tasks)
    try:
        while open_choices:
            ready: list[tuple[_Choice, TokenEvent | Exception]] = []
            for item in [await merged.get()] + [merged.get_nowait() for _ in range(merged.qsize())]:
                if item is None:
                    open_choices -= 1
                else:
                    ready.extend(item)
            if ready:
                yield ready
    finally:
        for task in tasks:
            task.cancel()


class OpenAIServing:
    """Turns parsed requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, llm: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 request_timeout: float | None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.jobs: dict[str, Job] = {}

    # --- building --------------------------------------------------------------------------------
    def _requests(self, parsed: ParsedRequest) -> list[EngineRequest]:
        """One engine request per prompt (a chat has one), built as the library builds them; a ``max_tokens``
        that does not fit beside the prompt is refused."""
        params = SamplingParams(**parsed.sampling)
        builder = self.llm.request_builder
        if parsed.endpoint == "chat":
            options = dict(parsed.chat_options)
            if parsed.drop_thinking is not None:
                options.setdefault("drop_thinking", parsed.drop_thinking)
            return [builder.build(params, messages=parsed.messages, chat_options=options, strict_budget=True)]
        return [builder.build(params, prompt=prompt, strict_budget=True) for prompt in parsed.prompts]

    @staticmethod
    def _choice_params(params: SamplingParams, choice: int) -> SamplingParams:
        """The ``choice``-th sample's parameters: its own seed, so that the choices differ."""
        if params.seed is None or not choice:
            return params
        return dataclasses.replace(params, seed=(params.seed + choice * SEED_STRIDE) % (1 << 63))

    async def _job(self, parsed: ParsedRequest, prefix: str) -> Job:
        """The request's choices, its prompts encoded in a worker thread (the chat template and the tokenizer
        run off the event loop, so a long prompt stalls no other stream); registered under its id."""
        request_id = parsed.request_id or f"{prefix}-{uuid.uuid4().hex}"
        if request_id in self.jobs:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        requests = await asyncio.to_thread(self._requests, parsed)
        if request_id in self.jobs:   # taken by another request while this one was encoded
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        choices = []
        for p, request in enumerate(requests):
            for i in range(parsed.n):
                index = p * parsed.n + i
                choices.append(_Choice(index, f"{request_id}-{index}", request.prompt_ids,
                                       self._choice_params(request.params, i)))
        job = Job(request_id, parsed.endpoint, choices, parsed.want_logprobs)
        job.forced_tool_calls = is_forced_tool_choice(parsed.chat_options.get("tool_choice"))
        job.prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        job.chat_output = requests[0].chat_output if parsed.endpoint == "chat" else None
        job.include_usage = parsed.include_usage
        self.jobs[request_id] = job
        return job

    def cancel(self, request_id: str, reason: str = "cancel") -> bool:
        """Cancel every choice of an active request (``reason``, the first one given, is counted in
        ``pocketllm:request_aborted_total`` when it ends); False if unknown or finished."""
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.aborted = job.aborted or reason
        self._cancel_choices(job)
        return True

    def _cancel_choices(self, job: Job) -> None:
        for choice in job.choices:
            self.llm.cancel(choice.engine_id)

    def cancel_all(self) -> None:
        for request_id in list(self.jobs):
            self.cancel(request_id, "shutdown")

    def _end(self, job: Job) -> None:
        """Unregister a job; count it if it was aborted."""
        self.jobs.pop(job.request_id, None)
        if job.aborted is not None:
            self.metrics.aborted.labels(reason=job.aborted).inc()

    # --- shaping ---------------------------------------------------------------------------------
    def _token_bytes(self, token_id: int) -> list[int]:
        return list(self.llm.tokenizer.token_bytes(token_id)) if self.llm.tokenizer else []

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": self._token_bytes(token_id)}

        return {"content": [{**one(e.token_id, e.token, e.logprob),
                             "top_logprobs": [one(t.token_id, t.token, t.logprob) for t in e.top]}
                            for e in entries]}

    def _completion_logprobs(self, entries: list[TokenLogprob], alternatives: int, start: int = 0) -> dict:
        offsets, position = [], start
        for e in entries:
            offsets.append(position)
            position += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries] if alternatives else None,
            "text_offset": offsets,
        }

    def _logprobs(self, job: Job, choice: _Choice, entries: list[TokenLogprob] | None,
                  text_offset: int = 0) -> dict | None:
        if not job.want_logprobs or entries is None:
            return None
        if job.endpoint == "chat":
            return self._chat_logprobs(entries)
        return self._completion_logprobs(entries, choice.params.logprobs or 0, text_offset)

    def _usage(self, job: Job, outputs: list[RequestOutput]) -> dict:
        completion = sum(o.usage.completion_tokens for o in outputs)
        return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
                "total_tokens": job.prompt_tokens + completion}

    def _envelope(self, job: Job, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.endpoint == "chat" \
            else "text_completion"
        return {"id": job.request_id, "object": kind, "created": job.created, "model": self.model_name}

    def _forced_tool_call_body(self, job: Job, choice: _Choice, output: RequestOutput) -> dict | None:
        """A forced tool_choice's answer as tool_calls; None (plain content) when it does not parse."""
        calls = parse_forced_tool_calls(output.text) if output.finish_reason == "stop" else None
        if calls is None:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
        if getattr(output, "reasoning_content", None) is not None:  # the grammar started after the reasoning
            message["reasoning_content"] = output.reasoning_content
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(job, choice, output.logprobs), "finish_reason": "tool_calls"}

    def _choice_body(self, job: Job, choice: _Choice, output: RequestOutput) -> dict:
        if job.forced_tool_calls:
            forced = self._forced_tool_call_body(job, choice, output)
            if forced is not None:
                return forced
        logprobs = self._logprobs(job, choice, output.logprobs)
        if job.endpoint == "chat":
            return {"index": choice.index, "message": self._message(output),
                    "logprobs": logprobs, "finish_reason": output.finish_reason}
        return {"index": choice.index, "text": output.text, "logprobs": logprobs,
                "finish_reason": output.finish_reason}

    @staticmethod
    def _message(output: RequestOutput) -> dict:
        """The assistant message: content, the reasoning when the model wrote one, and parsed tool calls
        (content is null when the answer was only calls, as OpenAI reports it)."""
        message: dict[str, Any] = {"role": "assistant", "content": output.text}
        if output.reasoning_content is not None:
            message["reasoning_content"] = output.reasoning_content
        if output.tool_calls:
            message["content"] = output.text or None
            message["tool_calls"] = [call.to_openai() for call in output.tool_calls]
        return message

    # --- running ---------------------------------------------------------------------------------
    def _record(self, job: Job, output: RequestOutput) -> None:
        self.metrics.observe(output, time.monotonic() - job.started)

    async def complete(self, parsed: ParsedRequest, prefix: str,
                       disconnected: Callable[[], Any]) -> dict:
        """A whole (non-streaming) response; choices that miss the deadline are left out."""
        job = await self._job(parsed, prefix)
        try:
            tasks = {asyncio.ensure_future(self.llm.generate([c.prompt_ids], c.params, request_id=c.engine_id,
                                                             chat_output=job.chat_output)): c
                     for c in job.choices}
            watcher = asyncio.ensure_future(self._watch_disconnect(job, disconnected))
            done, pending = await asyncio.wait(tasks, timeout=self.request_timeout)
            watcher.cancel()
            if pending:
                job.aborted = job.aborted or "deadline"
            for task in pending:
                self.llm.cancel(tasks[task].engine_id)
            if pending:
                await asyncio.wait(pending, timeout=30)
            results: list[tuple[_Choice, RequestOutput]] = []
            errors = []
            for task in done:
                if task.exception() is not None:
                    errors.append(task.exception())
                    continue
                output = task.result()[0]
                self._record(job, output)
                results.append((tasks[task], output))
            for task in pending:
                if task.done() and task.exception() is None:
                    self._record(job, task.result()[0])
            if not results:
                for error in errors:
                    if isinstance(error, InvalidRequestError):
                        raise error
                if pending:
                    raise RequestFailed(504, f"the request did not finish within {self.request_timeout} s")
                raise RequestFailed(500, f"no choice could be generated: {errors[0]!r}" if errors else
                                    "no choice could be generated")
            results.sort(key=lambda item: item[0].index)
            return {**self._envelope(job, chunk=False),
                    "choices": [self._choice_body(job, c, o) for c, o in results],
                    "usage": self._usage(job, [o for _, o in results])}
        finally:
            self._end(job)

    async def _watch_disconnect(self, job: Job, disconnected: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(0.05)
            if await disconnected():
                self.cancel(job.request_id, "client_disconnect")
                return

    async def prepare_stream(self, parsed: ParsedRequest, prefix: str) -> Job:
        """Validate and register a streaming request before the response starts (so errors are a 400)."""
        return await self._job(parsed, prefix)

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        """SSE chunks of every choice, interleaved as tokens arrive, then ``[DONE]``; the chunks that are ready
        together go out in one write."""
        batches = self.stream_batches(job)
        try:
            async for batch in batches:
                yield b"".join(sse(chunk) for chunk in batch)
        finally:
            await batches.aclose()

    async def stream_chunks(self, job: Job) -> AsyncIterator[dict | str]:
        """The stream's chunks one by one (``stream_batches``)."""
        batches = self.stream_batches(job)
        try:
            async for batch in batches:
                for chunk in batch:
                    yield chunk
        finally:
            await batches.aclose()

    async def stream_batches(self, job: Job) -> AsyncIterator[list[dict | str]]:
        """The stream's chunks (an ``{"error": ...}`` object for a failed choice or a missed deadline), then
        ``"[DONE]"``, in batches: what the engine delivered together; the job ends when the iterator is closed
        or exhausted."""
        timed_out = False
        ran_its_course = False
        timer = None
        if self.request_timeout is not None:
            def expire() -> None:
                nonlocal timed_out
                timed_out = True
                self.cancel(job.request_id, "deadline")

            timer = asyncio.get_running_loop().call_later(
                max(0.0, job.started + self.request_timeout - time.monotonic()), expire)
        arrivals = None
        try:
            arrivals = await self._open_choices(job)
            if job.endpoint == "chat":
                for choice in job.choices:
                    first = {**self._envelope(job, chunk=True), "choices": [
                        {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]}
                    yield [{**first, "usage": None} if job.include_usage else first]
            async for ready in arrivals:
                batch: list[dict | str] = []
                for choice, event in _coalesced(ready):
                    if isinstance(event, Exception):
                        batch.append({"error": {"message": str(event), "type": "server_error", "param": None,
                                                "code": None}})
                    else:
                        batch.extend(self._event_chunks(job, choice, event))
                if batch:
                    yield batch
            ran_its_course = True
            if timer is not None:
                timer.cancel()
            if timed_out:
                yield [{"error": {"message": f"the request did not finish within {self.request_timeout} s",
                                  "type": "timeout", "param": None, "code": 504}}]
            if job.include_usage:
                yield [{**self._envelope(job, chunk=True), "choices": [], "usage": self._usage(job, job.finished)}]
            yield ["[DONE]"]
        finally:
            if timer is not None:
                timer.cancel()
            if arrivals is not None:
                await arrivals.aclose()
            if not ran_its_course:   # the client went away (the response was closed mid-stream)
                job.aborted = job.aborted or "client_disconnect"
            self._cancel_choices(job)
            self._end(job)

    async def _open_choices(self, job: Job) -> AsyncIterator[list[tuple[_Choice, TokenEvent | Exception]]]:
        """Submit every choice now; return their engine events in lists of what arrived together, each with
        its choice (an exception for a choice that failed), until every choice's stream has ended. One choice
        is read directly; several by a task each, merged through a queue."""
        if len(job.choices) == 1:
            choice = job.choices[0]
            try:
                events = await self.llm.open_stream(choice.prompt_ids, choice.params, request_id=choice.engine_id,
                                                    chat_output=job.chat_output)
            except Exception as exc:   # reported to the client as an error event
                return _arrived([(choice, exc)])
            return _one_choice(choice, events)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for batch in self.llm.generate_stream_batches(choice.prompt_ids, choice.params,
                                                                    request_id=choice.engine_id,
                                                                    chat_output=job.chat_output):
                    merged.put_nowait([(choice, event) for event in batch])
            except Exception as exc:
                merged.put_nowait([(choice, exc)])
            finally:
                merged.put_nowait(None)

        return _merged(merged, [asyncio.ensure_future(pump(c)) for c in job.choices])

    def _stream_logprobs(self, job: Job, choice: _Choice, event: TokenEvent) -> dict | None:
        """The log-probabilities of the tokens whose text this chunk sends: those held with earlier, empty
        steps too; on the last chunk, whatever of the final output's entries was not sent (a matched stop
        string drops the tokens after it, as in a non-streamed response). A chunk carries its own step's token
        even when part of that token's text is still held back; should a stop string then cut that token, the
        stream has carried an entry that the whole response drops."""
        entries, choice.pending_logprobs = choice.pending_logprobs, []
        if event.output is not None and event.output.logprobs is not None:
            entries = event.output.logprobs[choice.sent_logprobs:]
        choice.sent_logprobs += len(entries)
        shaped = self._logprobs(job, choice, entries, choice.sent_offset)
        choice.sent_offset += sum(len(e.token) for e in entries)
        return shaped

    def _event_chunks(self, job: Job, choice: _Choice, event: TokenEvent) -> list[dict]:
        """The chunks one engine event makes: its text (held back on a forced tool call until the answer
        parses), and on the last event the parsed calls in OpenAI's streamed form, then the finish."""
        if event.output is not None:
            self._record(job, event.output)
            job.finished.append(event.output)
        if job.want_logprobs and event.logprobs:
            choice.pending_logprobs.extend(event.logprobs)
        text, calls = event.text, None
        if job.endpoint == "chat":
            if job.forced_tool_calls:
                choice.held.append(text)
                text = ""
                if event.finished:
                    output = event.output
                    calls = (parse_forced_tool_calls(output.text)
                             if output is not None and output.finish_reason == "stop" else None)
                    if calls is None:
                        text = "".join(choice.held)
            if event.tool_calls:
                calls = [call.to_openai() for call in event.tool_calls]
        # No text yet: held back (a stop string may begin here). Without a tokenizer there is never text, and
        # each token gets its (empty) chunk.
        if not (text or event.reasoning_content or event.finished) and self.llm.tokenizer is not None:
            return []
        logprobs = self._stream_logprobs(job, choice, event) if job.want_logprobs else None
        reason = ("tool_calls" if calls else event.finish_reason) if event.finished else None
        if job.endpoint != "chat":
            body = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            return [self._chunk(job, body)]
        delta: dict[str, Any] = {"content": text} if text else {}
        if event.reasoning_content:
            delta["reasoning_content"] = event.reasoning_content
        if not calls:
            return [self._chunk(job, {"index": choice.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": reason})]
        bodies = [{"index": choice.index, "delta": {"tool_calls": [entry]}, "logprobs": None, "finish_reason": None}
                  for entry in tool_call_deltas(calls)]
        if delta:
            bodies.insert(0, {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None})
        bodies[0]["logprobs"] = logprobs
        bodies.append({"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return [self._chunk(job, body) for body in bodies]

    def _chunk(self, job: Job, body: dict) -> dict:
        """One streamed chunk holding one choice's ``body``."""
        chunk = {**self._envelope(job, chunk=True), "choices": [body]}
        if job.include_usage:
            chunk["usage"] = None
        return chunk
