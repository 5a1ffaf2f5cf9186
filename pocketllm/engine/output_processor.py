"""Per-request front-end processing on the engine thread: detokenise, match stop strings, shape outputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pocketllm.engine.request import FinishReason, Request
from pocketllm.outputs import RequestOutput, TokenEvent, TokenLogprob, TopLogprob, Usage
from pocketllm.protocol.chat_output import ChatOutputSpec
from pocketllm.protocol.detokenizer import IncrementalDetokenizer
from pocketllm.protocol.reasoning import ReasoningSplitter
from pocketllm.protocol.stop import StopMatcher
from pocketllm.protocol.tool_parsers import ToolCallStream
from pocketllm.step.sampled import SampledToken


def usage_of(request: Request, completion_tokens: int | None = None) -> Usage:
    """Token counts (the EOS step included) and the request's prefill and decode wall times; ``completion_tokens``:
    the output tokens the caller received (default: all the request's)."""
    first = request.first_token_time
    scheduled = request.first_scheduled_time
    end = request.finished_time or time.monotonic()
    prefill = (first - scheduled) if first is not None and scheduled is not None else 0.0
    decode = (end - first) if first is not None and end is not None else 0.0
    queue = (scheduled - request.arrival_time) if scheduled is not None else 0.0
    if completion_tokens is None:
        completion_tokens = len(request.output_token_ids)
    return Usage(prompt_tokens=request.num_prompt_tokens, completion_tokens=completion_tokens,
                 prefill_time_s=prefill, decode_time_s=decode, cached_tokens=request.num_cached_tokens,
                 queue_time_s=queue)


class RequestStream:
    """Turns one request's sampled tokens into text events and its final output.

    ``emit`` receives a ``TokenEvent`` per step (when ``stream``) and then the final ``RequestOutput``.
    A matched stop string ends the request: the engine is told to stop generating at once.

    With a ``chat`` spec the decoded text goes through three stages in order: the reasoning split, the stop
    strings (on the answer only, never on the reasoning), and the all-or-nothing tool-call parse, whose
    call block is held back from the stream until it parses (then sent as calls) or the output ends.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 decode: Callable[[Sequence[int]], str] | None, token_text: Callable[[int], str] | None,
                 emit: Callable[[object], None], stream: bool, chat: ChatOutputSpec | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.detok = IncrementalDetokenizer(decode, self.prompt_token_ids) if decode else None
        self.stops = StopMatcher(stop)
        self.token_text = token_text
        self.emit = emit
        self.stream = stream
        self.token_ids: list[int] = []
        # Tokens handed to this stream: a verify step's tokens after a stop string never reach it.
        self.num_received = 0
        self.token_starts: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.token_gaps: list[float] = []
        self._last_token_time: float | None = None
        self.decoded_len = 0  # characters of decoded output so far (token starts are offsets into it)
        self.reasoning = (ReasoningSplitter(chat.reasoning, chat.reasoning_state)
                          if chat is not None and chat.reasoning is not None else None)
        self._reasoning_parts: list[str] = []
        self.calls = (ToolCallStream(chat.tool_parser, chat.tools)
                      if chat is not None and chat.tool_parser is not None else None)
        self.tool_calls = None

    def _logprob(self, token: SampledToken) -> TokenLogprob | None:
        if token.logprob is None:
            return None
        text = self.token_text or (lambda _: "")
        top = tuple(TopLogprob(i, text(i), lp) for i, lp in zip(token.top_ids, token.top_logprobs))
        return TokenLogprob(token.token_id, text(token.token_id), token.logprob, top)

    def _push_token(self, token: SampledToken) -> tuple[str, str, bool]:
        self.token_ids.append(token.token_id)
        self.token_starts.append(self.decoded_len)
        entry = self._logprob(token)
        if entry is not None:
            self.logprobs.append(entry)
        delta = self.detok.push([token.token_id]) if self.detok else ""
        return self._route(delta, final=False)

    def _route(self, decoded: str, final: bool) -> tuple[str, str, bool]:
        """Decoded text -> (reasoning delta, answer delta to show, stopped): split, stop, hold calls."""
        self.decoded_len += len(decoded)
        reasoning, answer = self.reasoning.push(decoded) if self.reasoning else ("", decoded)
        if final and self.reasoning:
            tail_reasoning, tail_answer = self.reasoning.flush()
            reasoning, answer = reasoning + tail_reasoning, answer + tail_answer
        if reasoning:
            self._reasoning_parts.append(reasoning)
        emitted, stopped = self.stops.push(answer)
        if final and not stopped:
            emitted += self.stops.flush()
            stopped = self.stops.stopped
        self.text += emitted
        shown = self.calls.push(emitted) if self.calls else emitted
        return reasoning, shown, stopped

    def on_output(self, request: Request, token: SampledToken | None, last: bool = True) -> bool:
        # Only the request's last token of the step can be the one that ended it.
        excluded = last and request.finish_reason is FinishReason.STOP and request.stop_reason is not None
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        delta, reasoning, stopped = "", "", False
        if token is not None:
            self.num_received += 1
            now = time.monotonic()
            if self._last_token_time is not None:
                self.token_gaps.append(now - self._last_token_time)
            self._last_token_time = now
        if token is not None and not excluded:
            count = len(self.logprobs)
            reasoning, delta, stopped = self._push_token(token)
            new_ids = [token.token_id]
            new_logprobs = self.logprobs[count:]
        finished = (request.is_finished and last) or stopped
        if finished and not stopped:
            tail_reasoning, tail, stopped = self._route(self.detok.flush() if self.detok else "", final=True)
            reasoning += tail_reasoning
            delta += tail
        if stopped:
            self._cut_to_text()
        if finished and self.calls is not None:
            # Calls count only when the model ended its answer itself (not on the budget or a cancel).
            tail, parsed = self.calls.finish(parse=stopped or request.finish_reason is FinishReason.STOP)
            delta += tail
            if parsed is not None:
                self.text = parsed.content or ""
                self.tool_calls = list(parsed.calls)
        final = self._final(request, stopped) if finished else None
        if self.stream and (delta or reasoning or new_ids or finished):
            self.emit(TokenEvent(self.request_id, delta, new_ids, finished,
                                 final.finish_reason if final else None, final.usage if final else None,
                                 new_logprobs if token is not None and token.logprob is not None else None,
                                 output=final, reasoning_content=reasoning,
                                 tool_calls=final.tool_calls if final else None))
        if final is not None:
            self.emit(final)
        return stopped

    def _cut_to_text(self) -> None:
        """Drop tokens (and their log-probs) that begin after the text the caller receives."""
        answer_start = self.reasoning.answer_start if self.reasoning else 0
        end = (answer_start or 0) + len(self.text)
        keep = sum(1 for start in self.token_starts if start < end) if end else 0
        self.token_ids = self.token_ids[:keep]
        self.logprobs = self.logprobs[:keep] if self.logprobs else self.logprobs

    def _finish_reason(self, request: Request, stopped: bool) -> str:
        if self.tool_calls:
            return "tool_calls"
        if stopped:
            return "stop"
        reason = request.finish_reason or FinishReason.STOP
        return reason.value

    def _final(self, request: Request, stopped: bool) -> RequestOutput:
        asked = request.params.logprobs is not None
        stop_reason = self.stops.matched if stopped else request.stop_reason
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, text=self.text,
            token_ids=list(self.token_ids), finish_reason=self._finish_reason(request, stopped),
            usage=usage_of(request, self.num_received), logprobs=list(self.logprobs) if asked else None,
            stop_reason=stop_reason,
            metadata={"inter_token_latencies": self.token_gaps},
            reasoning_content="".join(self._reasoning_parts) if self.reasoning and self.reasoning.saw_reasoning
            else None,
            tool_calls=self.tool_calls)

    def on_error(self, error: BaseException) -> None:
        self.emit(error)
