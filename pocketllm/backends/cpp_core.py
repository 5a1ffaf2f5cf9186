"""The native plane under the engine thread: ``NativeCore`` has the ``EngineCore`` surface the engine loop drives
(add, abort, finish, step, stats), each step one ``pocketllm_cpp.QwenBatchCore`` step."""

from __future__ import annotations

import random
import time
from typing import Any

from pocketllm.engine.engine_core import StepOutput
from pocketllm.engine.request import FinishReason, Request, RequestStatus
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED}


def refuse_unsupported(params: SamplingParams) -> None:
    """UnsupportedFeatureError for a sampling feature the native engine does not implement."""
    if params.structured_output is not None:
        raise UnsupportedFeatureError("the native plane (backend='cpp') does not implement structured outputs; "
                                      "drop the response format or use backend='torch'")


class _PrefillBudget:
    """The loop's ``core.scheduler.set_prefill_chunk`` over the native core's prefill token budget."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def set_prefill_chunk(self, tokens: int) -> None:
        self.batch.set_prefill_token_budget(tokens)


class NativeCore:
    """Requests in, one native batched step per ``step()``; EOS, budget and cancel decided natively."""

    pipelined = False

    def __init__(self, native: Any, engine: Any, max_slots: int, prefill_budget: int, seed: int) -> None:
        self.native = native
        self.engine = engine
        self.batch = native.QwenBatchCore(engine, max_slots)
        self.batch.set_prefill_token_budget(prefill_budget)
        self.scheduler = _PrefillBudget(self.batch)
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in engine.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seeds = random.Random(seed)   # seeds of requests that bring none: reproducible per engine seed

    def _sampling(self, prompt: list[int], params: SamplingParams) -> Any:
        sampling = self.native.QwenBatchSamplingParams()
        sampling.temperature = float(params.temperature)
        sampling.top_p = float(params.top_p)
        sampling.top_k = max(0, int(params.top_k))
        sampling.seed = int(params.seed) % (1 << 63) if params.seed is not None else self._seeds.getrandbits(63)
        budget = self.max_model_len - len(prompt)
        sampling.max_new_tokens = max(1, min(params.max_tokens, budget) if params.max_tokens is not None else budget)
        sampling.ignore_eos = bool(params.ignore_eos)
        sampling.stop_token_ids = [int(t) for t in params.stop_token_ids]
        sampling.logprobs = int(params.logprobs) if params.logprobs is not None else -1
        sampling.min_p = float(params.min_p)
        sampling.repetition_penalty = float(params.repetition_penalty)
        sampling.frequency_penalty = float(params.frequency_penalty)
        sampling.presence_penalty = float(params.presence_penalty)
        sampling.logit_bias = [(int(t), float(b)) for t, b in params.logit_bias.items()]
        return sampling

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request natively."""
        refuse_unsupported(params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already active", param="request_id")
        prompt = [int(t) for t in prompt_token_ids]
        try:
            self.batch.add(request_id, prompt, self._sampling(prompt, params))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from None
        request = Request(request_id, prompt, params, self.eos_token_ids)
        self.requests[request_id] = request
        return request

    def _end(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()

    def abort(self, request_id: str) -> Request | None:
        """Cancel an active request at this step boundary; its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.batch.cancel(request_id)
        self._end(request, FinishReason.CANCELLED)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request the front end decided is complete (a stop string matched)."""
        if self.requests.pop(request.request_id, None) is not None:
            self.batch.cancel(request.request_id)
            self._end(request, reason)

    def has_work(self) -> bool:
        return self.batch.has_work()

    def step(self) -> list[StepOutput]:
        """One native step: every running request's token, its end where it ended."""
        started = time.monotonic()
        for request in self.requests.values():
            if request.first_scheduled_time is None:
                request.first_scheduled_time = started
        events = self.batch.step()
        now = time.monotonic()
        outputs = []
        # A verify chunk gives a request several events; the last one of each request is marked.
        final = {event.request_id: index for index, event in enumerate(events)}
        for index, event in enumerate(events):
            request = self.requests.get(event.request_id)
            if request is None:
                continue
            request.num_cached_tokens = int(event.cached_tokens)
            token = None
            if event.token >= 0:
                token = SampledToken(int(event.token), event.logprob, list(event.top_ids),
                                     list(event.top_logprobs))
                request.output_token_ids.append(token.token_id)
                if request.first_token_time is None:
                    request.first_token_time = now
            if event.finish_reason:
                if event.eos:
                    request.stop_reason = int(event.token)
                self.requests.pop(event.request_id, None)
                self._end(request, _REASONS[event.finish_reason])
            outputs.append(StepOutput(request, token, last=final[event.request_id] == index,
                                      num_outputs=len(request.output_token_ids)))
        return outputs

    def stats(self) -> dict[str, float | int]:
        """The native core's load and cache counters, under the names ``EngineCore.stats`` uses."""
        stats = dict(self.batch.stats())
        total = stats["kv_cache_total_blocks"]
        stats["kv_cache_usage"] = 1.0 - stats["kv_cache_free_blocks"] / total if total else 0.0
        return stats
