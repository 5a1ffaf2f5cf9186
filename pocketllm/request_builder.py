"""Completion prompts and chat conversations made into engine requests: encoding, the checkpoint's chat template,
the structured output chat options ask for, and the generation budget.

The budget's default is the one of the library and the OpenAI server alike: without ``max_tokens`` a request may
generate up to the end of the context (``max_model_len`` minus its prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_output import ChatOutputSpec, ChatSyntax, chat_output_spec, detect_chat_syntax
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.protocol.structured_output import after_reasoning, structured_output_for
from pocketllm.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it: prompt token ids, sampling parameters with their budget, and for a
    chat how the answer is read back (reasoning split, tool calls)."""

    prompt_ids: list[int]
    params: SamplingParams
    chat_output: ChatOutputSpec | None = None


class RequestBuilder:
    """Builds ``EngineRequest``s for one model (its tokenizer, context length and structured-output support)."""

    def __init__(self, tokenizer: Any, max_model_len: int, structured_outputs: bool,
                 architecture: str | None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.structured_outputs = structured_outputs
        self.architecture = architecture

    def build(self, params: SamplingParams | None = None, *, prompt: Prompt | None = None,
              messages: Sequence[Mapping[str, Any]] | None = None, chat_options: Mapping[str, Any] | None = None,
              strict_budget: bool = False) -> EngineRequest:
        """The engine request of a completion ``prompt`` or a chat's ``messages`` (exactly one of them).

        ``chat_options`` are ``render_chat``'s options (tools, tool_choice, response_format, ...). Without
        ``max_tokens`` the request may use the rest of the context; ``strict_budget`` refuses a ``max_tokens``
        that does not fit beside the prompt (the OpenAI server's rule) instead of ending at the context.
        """
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("send a prompt or chat messages (exactly one)", param="prompt")
        params = params or SamplingParams()
        spec = None
        if messages is not None:
            options = dict(chat_options or {})
            prompt_ids, spec = self.prepare_chat(messages, **options)
            params = self.chat_params(params, options, spec)
        else:
            prompt_ids = self.encode_prompt(prompt)
        param = "prompt" if messages is None else "messages"
        if not prompt_ids:
            raise InvalidRequestError(f"the {param} encodes to no tokens: send at least one token of text",
                                      param=param)
        return EngineRequest(prompt_ids, self.budget(params, len(prompt_ids), strict=strict_budget, param=param),
                             spec)

    def budget(self, params: SamplingParams, prompt_len: int, *, strict: bool = False,
               param: str = "prompt") -> SamplingParams:
        """``params`` with ``max_tokens`` set: the rest of the context when absent (refused past it if
        ``strict``); a prompt that leaves no room for one token is refused."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequestError(
                f"the prompt is {prompt_len} tokens; this model's context is {self.max_model_len} tokens", param=param)
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=room)
        if strict and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the {prompt_len}-token prompt exceeds this model's context of "
                f"{self.max_model_len} tokens; ask for at most {room}", param="max_tokens")
        return params

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A completion prompt's token ids (text is encoded with the tokenizer's special tokens)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer; send token ids", param="prompt")
            self.check_text_fits(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The prompt text the checkpoint's own template makes of ``messages``."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("this checkpoint has no tokenizer or chat template", param="messages")
        special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
        return build_chat_prompt(tok.chat_template, messages, special_tokens=special,
                                 structured_outputs=self.structured_outputs, architecture=self.architecture,
                                 **options)

    @cached_property
    def chat_syntax(self) -> ChatSyntax:
        """Whether the checkpoint writes reasoning blocks and which call syntax it uses (read once)."""
        tok = self.tokenizer
        vocab = tok.hf.get_vocab() if tok is not None else {}
        return detect_chat_syntax(tok.chat_template if tok is not None else None, self.architecture,
                                  vocab.__contains__)

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]],
                     **options: Any) -> tuple[list[int], ChatOutputSpec | None]:
        """A conversation's prompt ids and how its answer is read back (reasoning split, tool calls)."""
        text = self.render_chat(messages, **options)
        syntax = self.chat_syntax
        if options.get("tool_choice") == "none":
            syntax = dataclasses.replace(syntax, tool_parser=None)
        spec = chat_output_spec(syntax, text, options.get("tools"))
        self.check_text_fits(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False), spec

    def check_text_fits(self, text: str, param: str) -> None:
        """Refuses, before paying for its encoding, a text that is certainly too long for the context (by the
        tokenizer's exact lower bound on its token count)."""
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:
            raise InvalidRequestError(f"the prompt is at least {least} tokens; this model's context is "
                                      f"{self.max_model_len} tokens", param=param)

    @staticmethod
    def chat_params(params: SamplingParams | None, options: Mapping[str, Any],
                    spec: ChatOutputSpec | None = None) -> SamplingParams:
        """``params`` with the structured output the chat options ask for (response_format, forced tool_choice),
        starting after the reasoning block on a thinking model (``spec``)."""
        params = params or SamplingParams()
        structured = after_reasoning(structured_output_for(options), spec)
        if structured is None:
            return params
        if params.structured_output is not None and params.structured_output != structured:
            raise InvalidRequestError("the sampling parameters carry a structured output and the chat options ask "
                                      "for another; send one of them", param="response_format")
        return dataclasses.replace(params, structured_output=structured)
