"""Per-request front-end processing on the engine thread: detokenise, match stop strings, shape outputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pocketllm.engine.request import FinishReason, Request
from pocketllm.outputs import RequestOutput, TokenEvent, TokenLogprob, TopLogprob, Usage
from pocketllm.protocol.detokenizer import IncrementalDetokenizer
from pocketllm.protocol.stop import StopMatcher
from pocketllm.runner.sampler import SampledToken


def usage_of(request: Request) -> Usage:
    """Token counts (the EOS step included) and the request's prefill and decode wall times."""
    first = request.first_token_time
    scheduled = request.first_scheduled_time
    end = request.finished_time or time.monotonic()
    prefill = (first - scheduled) if first is not None and scheduled is not None else 0.0
    decode = (end - first) if first is not None and end is not None else 0.0
    queue = (scheduled - request.arrival_time) if scheduled is not None else 0.0
    return Usage(prompt_tokens=request.num_prompt_tokens, completion_tokens=len(request.output_token_ids),
                 prefill_time_s=prefill, decode_time_s=decode, cached_tokens=request.num_cached_tokens,
                 queue_time_s=queue)


class RequestStream:
    """Turns one request's sampled tokens into text events and its final output.

    ``emit`` receives a ``TokenEvent`` per step (when ``stream``) and then the final ``RequestOutput``.
    A matched stop string ends the request: the engine is told to stop generating at once.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 decode: Callable[[Sequence[int]], str] | None, token_text: Callable[[int], str] | None,
                 emit: Callable[[object], None], stream: bool) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.detok = IncrementalDetokenizer(decode, self.prompt_token_ids) if decode else None
        self.stops = StopMatcher(stop)
        self.token_text = token_text
        self.emit = emit
        self.stream = stream
        self.token_ids: list[int] = []
        self.token_starts: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.token_gaps: list[float] = []
        self._last_token_time: float | None = None

    def _logprob(self, token: SampledToken) -> TokenLogprob | None:
        if token.logprob is None:
            return None
        text = self.token_text or (lambda _: "")
        top = tuple(TopLogprob(i, text(i), lp) for i, lp in zip(token.top_ids, token.top_logprobs))
        return TokenLogprob(token.token_id, text(token.token_id), token.logprob, top)

    def _push_token(self, token: SampledToken) -> tuple[str, bool]:
        self.token_ids.append(token.token_id)
        self.token_starts.append(len(self.text))
        entry = self._logprob(token)
        if entry is not None:
            self.logprobs.append(entry)
        delta = self.detok.push([token.token_id]) if self.detok else ""
        emitted, stopped = self.stops.push(delta)
        self.text += emitted
        return emitted, stopped

    def on_output(self, request: Request, token: SampledToken | None) -> bool:
        excluded = request.finish_reason is FinishReason.STOP and request.stop_reason is not None
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        delta, stopped = "", False
        if token is not None:
            now = time.monotonic()
            if self._last_token_time is not None:
                self.token_gaps.append(now - self._last_token_time)
            self._last_token_time = now
        if token is not None and not excluded:
            count = len(self.logprobs)
            delta, stopped = self._push_token(token)
            new_ids = [token.token_id]
            new_logprobs = self.logprobs[count:]
        finished = request.is_finished or stopped
        if finished and not stopped:
            tail = (self.detok.flush() if self.detok else "")
            emitted, stopped_late = self.stops.push(tail)
            self.text += emitted
            delta += emitted
            if not stopped_late:
                flushed = self.stops.flush()
                self.text += flushed
                delta += flushed
            stopped = stopped_late or self.stops.stopped
        if stopped:
            self._cut_to_text()
        final = self._final(request, stopped) if finished else None
        if self.stream and (delta or new_ids or finished):
            self.emit(TokenEvent(self.request_id, delta, new_ids, finished,
                                 final.finish_reason if final else None, final.usage if final else None,
                                 new_logprobs if token is not None and token.logprob is not None else None,
                                 output=final))
        if final is not None:
            self.emit(final)
        return stopped

    def _cut_to_text(self) -> None:
        """Drop tokens (and their log-probs) that begin after the text the caller receives."""
        keep = sum(1 for start in self.token_starts if start < len(self.text)) if self.text else 0
        keep = max(keep, 0)
        self.token_ids = self.token_ids[:keep]
        self.logprobs = self.logprobs[:keep] if self.logprobs else self.logprobs

    @staticmethod
    def _finish_reason(request: Request, stopped: bool) -> str:
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
            usage=usage_of(request), logprobs=list(self.logprobs) if asked else None, stop_reason=stop_reason,
            metadata={"inter_token_latencies": self.token_gaps})

    def on_error(self, error: BaseException) -> None:
        self.emit(error)
