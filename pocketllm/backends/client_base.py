"""What the in-process and the engine-process clients share: request ids, prompt encoding, output streams."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence

from pocketllm.engine.output_processor import RequestStream
from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_output import ChatOutputSpec
from pocketllm.request_builder import Prompt, RequestBuilder
from pocketllm.sampling_params import SamplingParams


class ClientBase:
    """The engine-independent half of an engine client; a subclass sets ``tokenizer`` and ``builder``."""

    tokenizer = None
    builder: RequestBuilder

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def new_request_id(self) -> str:
        return f"req-{self._prefix}-{next(self._counter)}"

    def request_ids(self, request_id: str | None, count: int) -> list[str]:
        """Ids for a batch: fresh ones, the caller's id, or the caller's id suffixed per prompt."""
        if request_id is None:
            return [self.new_request_id() for _ in range(count)]
        return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.builder.encode_prompt(prompt)

    @property
    def architecture(self) -> str | None:
        """The checkpoint's architecture name (``Qwen3ForCausalLM``), when known."""
        return self.builder.architecture

    @property
    def max_model_len(self) -> int:
        return self.builder.max_model_len

    def _kept_special_ids(self, chat: ChatOutputSpec | None) -> frozenset[int]:
        """Special tokens that spell a reasoning or call marker: decoding must keep them to split the text."""
        tok = self.tokenizer
        kept = set()
        for marker in chat.markers if chat is not None else ():
            ids = tok.encode(marker, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in tok.special_token_ids:
                kept.add(ids[0])
        return frozenset(kept)

    def request_stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       emit: Callable[[object], None], stream: bool,
                       chat: ChatOutputSpec | None = None) -> RequestStream:
        """The detokenising output stream of one request (text, stop strings, reasoning and tool calls)."""
        tok = self.tokenizer
        decode = None
        token_text = None
        if tok is not None:
            skip = params.skip_special_tokens
            kept = self._kept_special_ids(chat) if skip else frozenset()
            dropped = tok.special_token_ids - kept

            def decode(ids: Sequence[int]) -> str:
                if kept:
                    return tok.decode([i for i in ids if i not in dropped], skip_special_tokens=False)
                return tok.decode(ids, skip_special_tokens=skip)

            token_text = tok.token_text
        return RequestStream(request_id, prompt_ids, params.stop, decode, token_text, emit, stream, chat=chat)


def check_prefill_budget(tokens: int) -> None:
    """Refuse a prefill token budget that is not an integer >= 0."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidRequestError("the prefill token budget must be an integer >= 0", param="tokens")
