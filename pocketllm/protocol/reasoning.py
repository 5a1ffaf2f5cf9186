"""Reasoning blocks (``<think>…</think>``): which checkpoints write them, and splitting them off the answer.

A checkpoint writes reasoning when its chat template understands the block (it mentions ``</think>``: it
closes the block in its generation prompt, or splits it off earlier assistant turns) and its tokenizer has
``<think>`` and ``</think>`` tokens, or when its architecture's own encoder writes the block (DeepSeek-V4).
Nothing is guessed from the generated text alone.

Where the output starts is read from the rendered prompt: a prompt that ends by opening the block (Qwen3
with ``enable_thinking``, DeepSeek-V4 in thinking mode, newer R1 templates) puts the model inside the
reasoning; one that ends by closing it (thinking switched off) puts it in the answer; otherwise the model
may open the block itself as the first thing it writes (Qwen3 by default, DeepSeek-R1 distills).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2.nodes

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_template import _environment as chat_environment
from pocketllm.protocol.tool_parsers.base import back_over_space, marker_prefix_start

__all__ = [
    "ANSWER",
    "INSIDE",
    "OPEN",
    "ReasoningSplitter",
    "ReasoningSyntax",
    "check_reasoning_kept",
    "detect_reasoning",
    "drop_earlier_reasoning",
    "initial_state",
    "template_reasoning_effort",
]

THINK_START = "<think>"
THINK_END = "</think>"

OPEN = "open"  # the model may open the block as the first thing it writes
INSIDE = "inside"  # the prompt opened the block: the output starts in the reasoning
ANSWER = "answer"  # the prompt closed the block (or there is none to open): everything is the answer
_INSIDE_LEAD, _ANSWER_LEAD = "inside_lead", "answer_lead"


@dataclass(frozen=True)
class ReasoningSyntax:
    """The markers around a reasoning block."""

    start: str = THINK_START
    end: str = THINK_END


def detect_reasoning(template: str | None, has_token: Callable[[str], bool] | None,
                     encoder_writes_reasoning: bool = False) -> ReasoningSyntax | None:
    """The checkpoint's reasoning syntax, or None when it writes no reasoning block."""
    if encoder_writes_reasoning:
        return ReasoningSyntax()
    if template is None or THINK_END not in template:
        return None
    if has_token is not None and not (has_token(THINK_START) and has_token(THINK_END)):
        return None
    return ReasoningSyntax()


def initial_state(syntax: ReasoningSyntax, prompt: str) -> str:
    """Where the output starts, read from the end of the rendered prompt."""
    tail = prompt.rstrip()
    if tail.endswith(syntax.start):
        return INSIDE
    if tail.endswith(syntax.end):
        return ANSWER
    return OPEN


class ReasoningSplitter:
    """Splits the decoded output, as it streams, into reasoning and answer text.

    ``push`` returns ``(reasoning_delta, answer_delta)``; text that may be the start of a marker (and the
    whitespace before a possible end marker) is held until the next push or ``flush``. The reasoning is
    trimmed of the whitespace around it, and the answer after a closed block starts at its first
    non-space character; an answer with no block is left exactly as generated. ``answer_start`` is the
    offset in the decoded output where the answer begins (None until it has begun).
    """

    def __init__(self, syntax: ReasoningSyntax, state: str = OPEN) -> None:
        self.syntax = syntax
        self.state = _INSIDE_LEAD if state == INSIDE else state
        self.saw_reasoning = state == INSIDE
        self.answer_start: int | None = 0 if state == ANSWER else None
        self._buf = ""  # text not settled yet
        self._pos = 0  # offset of ``_buf`` in the decoded output

    def push(self, delta: str) -> tuple[str, str]:
        """Add decoded text; return the reasoning and answer text that is settled."""
        self._buf += delta
        return self._advance(final=False)

    def flush(self) -> tuple[str, str]:
        """End of output: settle whatever is held."""
        return self._advance(final=True)

    def _consume(self, count: int) -> None:
        self._buf = self._buf[count:]
        self._pos += count

    def _skip_space(self, rest: str) -> str:
        body = rest.lstrip()
        self._consume(len(rest) - len(body))
        return body

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        start, end = self.syntax.start, self.syntax.end
        while True:
            rest = self._buf
            if self.state == ANSWER:
                answer.append(rest)
                self._consume(len(rest))
                break
            if self.state == OPEN:
                body = rest.lstrip()
                if body.startswith(start):
                    self._consume(len(rest) - len(body) + len(start))
                    self.state, self.saw_reasoning = _INSIDE_LEAD, True
                    continue
                if not final and start.startswith(body):
                    break  # nothing yet, or a prefix of the opening marker: wait
                self.state, self.answer_start = ANSWER, self._pos
                continue
            if self.state in (_INSIDE_LEAD, _ANSWER_LEAD):
                if not self._skip_space(rest):
                    break
                if self.state == _ANSWER_LEAD:
                    self.answer_start = self._pos
                self.state = "inside" if self.state == _INSIDE_LEAD else ANSWER
                continue
            # Inside the reasoning block.
            found = rest.find(end)
            if found >= 0:
                reasoning.append(rest[:found].rstrip())
                self._consume(found + len(end))
                self.state = _ANSWER_LEAD
                continue
            if final:
                reasoning.append(rest.rstrip())
                self._consume(len(rest))
                break
            settled = back_over_space(rest, marker_prefix_start(rest, (end,)))
            reasoning.append(rest[:settled])
            self._consume(settled)
            break
        return "".join(reasoning), "".join(answer)


# ----------------------------------------------------------------------------------------------------
# Request options mapped to what the checkpoint's template understands
# ----------------------------------------------------------------------------------------------------

# For each requested effort, the template values that honour it, best first (e.g. Qwen spells the top
# levels "xhigh": high and max map there when the template has no "high"/"max" of its own).
EFFORT_LADDER: dict[str, tuple[str, ...]] = {
    "none": ("none",),
    "minimal": ("minimal", "low"),
    "low": ("low",),
    "medium": ("medium",),
    "high": ("high", "xhigh"),
    "xhigh": ("xhigh", "high", "max"),
    "max": ("max", "xhigh", "high"),
}
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _names(node: jinja2.nodes.Node, name: str) -> bool:
    """Whether ``node`` is the variable ``name`` (possibly through filters such as ``default``)."""
    while isinstance(node, jinja2.nodes.Filter):
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.name == name


def _constants(node: jinja2.nodes.Node) -> list[str]:
    if isinstance(node, jinja2.nodes.Const) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (jinja2.nodes.List, jinja2.nodes.Tuple)):
        return [item.value for item in node.items
                if isinstance(item, jinja2.nodes.Const) and isinstance(item.value, str)]
    return []


@lru_cache(maxsize=32)
def template_values(template: str, name: str) -> frozenset[str] | None:
    """The string values a template compares the variable ``name`` against (``==``, ``in``, dict lookups);
    None when it compares it against none (it takes the value free-form, or not at all)."""
    tree = chat_environment().parse(template)
    values: set[str] = set()
    for node in tree.find_all(jinja2.nodes.Compare):
        operands = [node.expr, *(op.expr for op in node.ops)]
        if any(_names(operand, name) for operand in operands):
            for operand in operands:
                values.update(_constants(operand))
    for node in tree.find_all(jinja2.nodes.Getitem):
        if _names(node.arg, name) and isinstance(node.node, jinja2.nodes.Dict):
            values.update(pair.key.value for pair in node.node.items
                          if isinstance(pair.key, jinja2.nodes.Const) and isinstance(pair.key.value, str))
    return frozenset(values) or None


def template_reasoning_effort(template: str, effort: str) -> str:
    """The template's own spelling of a requested reasoning effort; refused when it has none."""
    if "reasoning_effort" not in template:
        raise InvalidRequestError("this model's chat template takes no reasoning effort; omit reasoning_effort",
                                  param="reasoning_effort")
    known = template_values(template, "reasoning_effort")
    if known is None:
        return effort
    for candidate in EFFORT_LADDER.get(effort, (effort,)):
        if candidate in known:
            return candidate
    raise InvalidRequestError(
        f"reasoning_effort={effort!r} has no equivalent in this model's chat template, which knows "
        f"{', '.join(sorted(known))}; send one of those", param="reasoning_effort")


def _last_user(messages: Sequence[Mapping[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "user"),
               default=-1)


def _reasoning_of(message: Mapping[str, Any]) -> str | None:
    return next((message[key] for key in _REASONING_KEYS if isinstance(message.get(key), str)), None)


def drop_earlier_reasoning(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Copies of the messages without the reasoning of assistant turns before the last user message
    (a reasoning field, or a ``<think>`` block at the head of the content). The caller's objects are kept."""
    last = _last_user(messages)
    out: list[Mapping[str, Any]] = []
    for index, message in enumerate(messages):
        if index < last and isinstance(message, Mapping) and message.get("role") == "assistant":
            message = {k: v for k, v in message.items() if k not in _REASONING_KEYS}
            content = message.get("content")
            if isinstance(content, str) and THINK_END in content:
                message["content"] = content.split(THINK_END)[-1].lstrip()
        out.append(message)
    return out


def check_reasoning_kept(messages: Sequence[Mapping[str, Any]], rendered: str) -> None:
    """``drop_thinking: false``: refuse when the template left out the reasoning of an earlier turn."""
    last = _last_user(messages)
    for message in messages[:max(last, 0)]:
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            reasoning = _reasoning_of(message)
            if reasoning and reasoning.strip() not in rendered:
                raise InvalidRequestError(
                    "this model's chat template leaves out the reasoning of earlier assistant turns, so "
                    "drop_thinking=false cannot be honoured; omit drop_thinking or send true",
                    param="drop_thinking")


def effort_from_reasoning(reasoning: Any, reasoning_effort: str | None) -> str | None:
    """The effort of a ``reasoning: {"effort": ...}`` option (the library's other spelling of
    ``reasoning_effort``); refused when malformed or when it contradicts ``reasoning_effort``."""
    if not isinstance(reasoning, Mapping) or set(reasoning) - {"effort"}:
        raise InvalidRequestError('reasoning must be an object {"effort": ...}; no other key is acted on',
                                  param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return reasoning_effort
    if reasoning_effort is not None and reasoning_effort != effort:
        raise InvalidRequestError("reasoning.effort and reasoning_effort disagree; send one of them",
                                  param="reasoning")
    return effort
