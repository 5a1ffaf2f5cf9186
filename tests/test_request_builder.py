"""The one request builder of the library and the server: prompts, the max_tokens default, the budget rules."""

from __future__ import annotations

import pytest

from pocketllm.engine.request import Request
from pocketllm.errors import InvalidRequestError
from pocketllm.request_builder import RequestBuilder
from pocketllm.sampling_params import SamplingParams


class _Tokenizer:
    """Encodes a text as one token per character."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += 1
        return [ord(c) for c in text]

    def min_tokens(self, text: str) -> int:
        return len(text)


def _builder(context: int = 16) -> RequestBuilder:
    return RequestBuilder(_Tokenizer(), context, structured_outputs=False, architecture=None)


def test_max_tokens_defaults_to_the_rest_of_the_context():
    request = _builder().build(prompt="abcd")
    assert request.prompt_ids == [97, 98, 99, 100] and request.params.max_tokens == 12
    assert request.chat_output is None
    assert _builder().build(SamplingParams(max_tokens=3), prompt=[1, 2]).params.max_tokens == 3


def test_a_budget_past_the_context_ends_there_or_is_refused_when_strict():
    assert _builder().build(SamplingParams(max_tokens=100), prompt=[1, 2]).params.max_tokens == 100
    with pytest.raises(InvalidRequestError) as info:
        _builder().build(SamplingParams(max_tokens=100), prompt=[1, 2], strict_budget=True)
    assert info.value.param == "max_tokens" and "at most 14" in str(info.value)


def test_a_prompt_that_fills_the_context_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        _builder(4).build(prompt="abcd")
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        _builder().build(prompt="ab", messages=[{"role": "user", "content": "x"}])


def test_a_text_certainly_too_long_is_refused_before_it_is_encoded():
    builder = _builder(4)
    with pytest.raises(InvalidRequestError) as info:
        builder.build(prompt="x" * 10_000)
    assert info.value.param == "prompt" and "at least 10000 tokens" in str(info.value)
    assert builder.tokenizer.encoded == 0


@pytest.mark.parametrize(("max_tokens", "outputs", "pending", "ends"), [
    (None, 5, 0, False), (None, 11, 0, True), (None, 10, 1, True),
    (4, 3, 0, False), (4, 4, 0, True), (4, 3, 1, True),
])
def test_one_length_rule(max_tokens, outputs, pending, ends):
    request = Request("r", [1] * 5, SamplingParams(max_tokens=max_tokens), frozenset())
    request.output_token_ids = [2] * outputs
    assert request.reaches_length_limit(16, pending) is ends


def test_a_prompt_of_no_tokens_is_refused_by_name():
    for prompt in ("", []):
        with pytest.raises(InvalidRequestError, match="encodes to no tokens") as info:
            _builder().build(prompt=prompt)
        assert info.value.param == "prompt"
