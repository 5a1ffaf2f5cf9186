"""Grammar-constrained sampling with xgrammar: compiled-grammar cache, per-request matchers, token bitmasks.

One :class:`GrammarCompiler` belongs to the engine. It builds xgrammar's tokenizer info from the vocabulary's
raw bytes the first time a structured request arrives, compiles each distinct grammar once (cached by its
canonical schema text) and hands every request its own :class:`GrammarMatcher`.

The matcher's life:

- created when the request is added to the engine;
- asked for the allowed next tokens by the sampler, which fills one row of a packed ``int32`` bitmask per
  constrained row and sets every disallowed logit to ``-inf`` before penalties, argmax or sampling (the
  raw log-probabilities are computed before that and do not see the mask);
- advanced by the engine once per token appended to the request's output. Recomputing a preempted
  request's KV never samples the tokens it already has, so the matcher is never advanced twice for them.

For a thinking model the grammar starts after the reasoning block: inside it (the prompt opened it, or the
model's first token did) nothing is masked until the end marker token.

End-of-sequence: the engine's EOS ids (and the request's ``stop_token_ids``) are the matcher's stop tokens,
so the mask allows them only when the grammar is complete, and nothing else then.

Special and added tokens (``<|im_end|>`` and the like) are handed to xgrammar as empty strings, which it
treats as special: they can never appear inside the JSON text.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.sampling_params import StructuredOutput

logger = logging.getLogger("pocketllm.grammar")

__all__ = ["GrammarCompiler", "GrammarMatcher", "apply_bitmask", "fill_bitmask", "xgrammar_available"]

# Matches xgrammar's packing: bit j of word w allows token 32 * w + j.
_BITS = 32


def xgrammar_available() -> bool:
    """Whether the xgrammar package is installed (structured outputs need it); it is imported on first use."""
    return importlib.util.find_spec("xgrammar") is not None


# Where a matcher stands relative to a thinking model's reasoning block.
_ACTIVE = "active"  # the grammar applies
_MAY_OPEN = "may_open"  # first token: the grammar's first tokens, or the reasoning start marker
_REASONING = "reasoning"  # inside the block: free text until the end marker


class GrammarMatcher:
    """One request's position in its grammar (and, for a thinking model, in its reasoning block).

    ``reasoning_ids``: the (start, end) marker token ids when the grammar starts after the reasoning block;
    ``in_reasoning``: the prompt already opened it.
    """

    def __init__(self, matcher, vocab_size: int, reasoning_ids: tuple[int, int] | None = None,
                 in_reasoning: bool = False) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self._reasoning_ids = reasoning_ids
        self.state = _ACTIVE if reasoning_ids is None else (_REASONING if in_reasoning else _MAY_OPEN)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32, all bits set on entry); False when
        every token is allowed (the row is then left as it is)."""
        if self.state == _REASONING:
            return False
        restricts = bool(self._matcher.fill_next_token_bitmask(bitmask, row))
        if self.state == _MAY_OPEN and restricts:
            start = self._reasoning_ids[0]
            word = int(bitmask[row, start // _BITS]) | (1 << (start % _BITS))
            bitmask[row, start // _BITS] = word - (1 << _BITS) if word >= 1 << (_BITS - 1) else word
        return restricts

    def accept(self, token_id: int) -> bool:
        """Advance past one generated token; False (state unchanged) if the grammar does not allow it."""
        token_id = int(token_id)
        if self.state == _MAY_OPEN:
            if token_id == self._reasoning_ids[0]:
                self.state = _REASONING
                self.num_accepted += 1
                return True
            self.state = _ACTIVE
        elif self.state == _REASONING:
            if token_id == self._reasoning_ids[1]:
                self.state = _ACTIVE
            self.num_accepted += 1
            return True
        ok = bool(self._matcher.accept_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_completed(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_completed())

    @property
    def is_terminated(self) -> bool:
        """Whether a stop token was accepted after a complete sentence."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles structured outputs for one vocabulary and caches the results by grammar.

    ``vocab_bytes`` is called once, on first use, and returns the raw bytes of every token id in order;
    ``special_token_ids`` are never allowed inside the text; ``vocab_size`` is the model's (logits) width,
    which may exceed the tokenizer's; ``stop_token_ids`` are the engine's EOS ids. Thread-safe.
    """

    def __init__(self, vocab_bytes: Callable[[], Sequence[bytes]], special_token_ids: Iterable[int],
                 vocab_size: int, stop_token_ids: Iterable[int], max_cached: int = 128,
                 max_threads: int = 4) -> None:
        self._vocab_bytes = vocab_bytes
        self._special = frozenset(special_token_ids)
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self.max_cached = max_cached
        self._max_threads = max_threads
        self._compiler = None
        self._token_ids: dict[bytes, int] = {}  # raw bytes -> id, for reasoning markers
        self._cache: OrderedDict[tuple[str, str | None], object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""
        return math.ceil(self.vocab_size / _BITS)

    def _xgr_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError as exc:
                raise UnsupportedFeatureError("structured outputs need the xgrammar package") from exc
            vocab = list(self._vocab_bytes())[: self.vocab_size]
            for index, piece in enumerate(vocab):
                self._token_ids.setdefault(piece, index)
            for index in self._special:
                if index < len(vocab):
                    vocab[index] = b""  # xgrammar treats an empty token as special
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                          stop_token_ids=list(self.stop_token_ids))
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, structured: StructuredOutput):
        """The compiled grammar of ``structured`` (cached); a schema that does not compile is a 400."""
        key = (structured.kind, structured.json_schema)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiler = self._xgr_compiler()
            try:
                if structured.json_object:
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                            strict_mode=False)
                else:
                    # Compact separators: a small model left free to choose whitespace can loop on it.
                    compiled = compiler.compile_json_schema(structured.json_schema, any_whitespace=False,
                                                            strict_mode=True)
            except Exception as exc:
                raise InvalidRequestError(f"the JSON schema cannot be compiled into a grammar: {exc}",
                                          param=structured.param) from None
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, structured: StructuredOutput, extra_stop_token_ids: Iterable[int] = ()) -> GrammarMatcher:
        """A fresh matcher at the start of ``structured``'s grammar; ``extra_stop_token_ids`` also end it."""
        import xgrammar

        compiled = self.compile(structured)
        stops = sorted(set(self.stop_token_ids) | {t for t in extra_stop_token_ids if t < self.vocab_size})
        reasoning_ids = None
        if structured.reasoning is not None:
            ids = [self._token_ids.get(marker.encode("utf-8")) for marker in structured.reasoning]
            if None in ids:
                raise InvalidRequestError(
                    f"the reasoning markers {list(structured.reasoning)} are not single tokens of this vocabulary, "
                    "so the grammar cannot start after the reasoning block", param=structured.param)
            reasoning_ids = (ids[0], ids[1])
        return GrammarMatcher(xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops or None),
                              self.vocab_size, reasoning_ids, structured.in_reasoning)

    def __len__(self) -> int:
        return len(self._cache)


def fill_bitmask(matchers: Sequence[GrammarMatcher], width: int) -> torch.Tensor | None:
    """A CPU ``[len(matchers), width]`` int32 bitmask of each matcher's allowed next tokens.

    None when no matcher restricts anything (every bit set), so the caller can skip the mask.
    """
    bitmask = torch.full((len(matchers), width), -1, dtype=torch.int32)
    restricts = False
    for row, matcher in enumerate(matchers):
        restricts |= matcher.fill(bitmask, row)
    return bitmask if restricts else None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set ``logits[rows[i], t]`` to ``-inf`` wherever bit ``t`` of ``bitmask[i]`` is 0, in place.

    ``logits`` is ``[B, V]`` on any device; ``bitmask`` is ``[len(rows), ceil(V/32)]`` int32 (CPU or the
    logits' device); ``rows`` defaults to every row. Tokens past the bitmask's width are disallowed.
    """
    device = logits.device
    vocab = logits.shape[-1]
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).to(torch.bool).reshape(words.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    if rows is None or (len(rows) == logits.shape[0] and list(rows) == list(range(logits.shape[0]))):
        logits.masked_fill_(~allowed, -math.inf)
        return
    index = torch.tensor(list(rows), dtype=torch.long, device=device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, -math.inf))
