"""A thin wrapper over a transformers fast tokenizer, loaded from an HF directory or a GGUF file."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from functools import cached_property, lru_cache
from typing import Any

from pocketllm.errors import CheckpointError, InvalidRequestError

logger = logging.getLogger("pocketllm.tokenizer")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# Pre-tokenizers that drop part of the text (whitespace, delimiters): a token may then stand for more input.
_DROPPING_PRE_TOKENIZERS = ('"Whitespace"', '"WhitespaceSplit"', '"BertPreTokenizer"', '"CharDelimiterSplit"',
                            '"Removed"')


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (printable bytes map to themselves, others to 256+n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


def _pick_template(value: Any) -> str | None:
    """A chat template given as a string, a {name: template} dict or a [{name, template}] list."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("default")
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def _template_from_files(directory: str) -> str | None:
    """``chat_template`` of tokenizer_config.json, else the ``chat_template.jinja`` file."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as handle:
            template = _pick_template(json.load(handle).get("chat_template"))
        if template:
            return template
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as handle:
            return handle.read()
    return None


class Tokenizer:
    """Thin wrapper over a transformers fast tokenizer."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self.hf = hf_tokenizer
        self.chat_template: str | None = chat_template or _pick_template(hf_tokenizer.chat_template)
        self.bos_token: str | None = hf_tokenizer.bos_token
        self.eos_token: str | None = hf_tokenizer.eos_token
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self._added_ids = frozenset(hf_tokenizer.added_tokens_decoder)
        self.special_token_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids) | frozenset(
            index for index, token in hf_tokenizer.added_tokens_decoder.items() if token.special)
        self.add_bos_token: bool = self._prepends_bos()
        self._byte_level = self._is_byte_level()
        self._backend = self._plain_backend()

    @classmethod
    def from_checkpoint_dir(cls, path: str) -> Tokenizer:
        """Tokenizer files of a local HF directory (tokenizer.json / tokenizer_config.json)."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot load the tokenizer in {path!r}: {exc}") from exc
        return cls(hf, _pick_template(hf.chat_template) or _template_from_files(path))

    @classmethod
    def from_gguf(cls, gguf_path: str) -> Tokenizer:
        """The tokenizer a GGUF file describes in its ``tokenizer.*`` metadata (converted once, then loaded from the
        user's cache: ``gguf_cache.py``)."""
        from pocketllm.tokenizer import gguf_cache

        cached = gguf_cache.load(gguf_path)
        if cached is not None:
            return cls(cached)
        from transformers import PreTrainedTokenizerFast

        directory, name = os.path.split(os.path.abspath(gguf_path))
        try:
            # Same conversion AutoTokenizer runs for a GGUF, without its slow full-metadata pass for the class.
            hf = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot build a tokenizer from {gguf_path!r}: {exc}") from exc
        hf = _repair_gguf_special_tokens(hf, read_gguf_vocab(gguf_path))
        gguf_cache.store(gguf_path, hf)
        return cls(hf)

    def _prepends_bos(self) -> bool:
        """Whether plain-text encoding adds BOS (observed, since the config flag is not always honest)."""
        if self.bos_token_id is None:
            return False
        with_special = self.encode("a", add_special_tokens=True)
        return with_special[:1] == [self.bos_token_id] and self.encode("a", False)[:1] != [self.bos_token_id]

    def _plain_backend(self) -> Any:
        """The Rust tokenizer behind the HF one when decoding through it gives the HF result (observed: no
        clean-up of spaces in this version and configuration), else None. Streaming decodes every generated
        token twice, and the HF wrapper costs more than the decode itself (~35 µs a call on a small CPU)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        probe = self.encode("Do n't , say it ' s so ? ( ok ) .", add_special_tokens=False)
        for skip in (True, False):
            if backend.decode(probe, skip_special_tokens=skip) != self.hf.decode(probe, skip_special_tokens=skip):
                return None
        return backend

    def _is_byte_level(self) -> bool:
        decoder = getattr(self.hf.backend_tokenizer, "decoder", None)
        return decoder is not None and b"ByteLevel" in decoder.__getstate__()

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of input text one token can stand for, when that is exact: a byte-level BPE without a
        normalizer, a pre-tokenizer that drops nothing and no added token that swallows the spaces around it
        (each token then covers exactly its own bytes of the input); else None."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or not self._byte_level or backend.normalizer is not None:
            return None
        if any(token.lstrip or token.rstrip for token in self.hf.added_tokens_decoder.values()):
            return None
        pre = backend.pre_tokenizer
        state = pre.__getstate__().decode("utf-8", "replace") if pre is not None else ""
        if any(kind in state for kind in _DROPPING_PRE_TOKENIZERS):
            return None
        return max(len(piece) for piece in self.vocab_bytes())

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))`` computed without encoding (0 when none is exact)."""
        most = self.max_token_bytes
        if not most:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // most)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, exactly as the HF tokenizer's ``__call__`` gives them."""
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of a token sequence."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Surface text of one token (``decode([id])``, special tokens kept)."""
        return self.decode([self._checked(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes one token stands for (may be part of a multi-byte character)."""
        piece = self.hf.convert_ids_to_tokens(self._checked(token_id))
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            table = byte_level_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")

    def vocab_bytes(self) -> list[bytes]:
        """``token_bytes`` of every id, in id order (for grammar engines)."""
        return [self.token_bytes(index) for index in range(self.vocab_size)]

    def _checked(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise InvalidRequestError(f"token id {token_id!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def read_gguf_vocab(gguf_path: str) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file (token list included)."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata

        found, _ = read_gguf_metadata(gguf_path, ("tokenizer.ggml.tokens",))
        return {key: value for key, value in found.items() if key.startswith("tokenizer.ggml.")}
    except (ImportError, TypeError):  # that fast reader is transformers-internal; fall back to gguf's own
        from gguf import GGUFReader

        reader = GGUFReader(gguf_path)
        return {key: field.contents() for key, field in reader.fields.items()
                if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.merges"}


def _misplaced_tokens(hf: Any, tokens: list[str], types: list[int]) -> list[tuple[int, str, bool]]:
    """Control/user-defined GGUF tokens that the converted tokenizer does not map to their GGUF id."""
    vocab = hf.get_vocab()
    return [(index, token, kind == _GGUF_CONTROL) for index, (token, kind) in enumerate(zip(tokens, types))
            if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED) and vocab.get(token) != index]


def _fix_post_processor(processor: dict | None, ids: dict[str, int]) -> None:
    """Point template special tokens at their repaired ids (recursing into processor sequences)."""
    if not processor:
        return
    for child in processor.get("processors") or []:
        _fix_post_processor(child, ids)
    for spec in (processor.get("special_tokens") or {}).values():
        spec["ids"] = [ids.get(token, old) for token, old in zip(spec["tokens"], spec["ids"])]


def _repair_gguf_special_tokens(hf: Any, vocab: dict[str, Any]) -> Any:
    """Give every control/user-defined GGUF token its GGUF id, and drop tokens past the GGUF vocabulary.

    transformers' GGUF conversion spells non-ASCII control tokens of byte-level vocabularies (DeepSeek's
    ``<｜begin▁of▁sentence｜>``) in the byte alphabet, then appends the BOS/EOS strings as new tokens past the
    model's vocabulary. llama.cpp matches those tokens as written, at their own ids; so do we.
    """
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens = list(vocab.get("tokenizer.ggml.tokens") or [])
    misplaced = _misplaced_tokens(hf, tokens, list(vocab.get("tokenizer.ggml.token_type") or []))
    extra = [index for index in hf.added_tokens_decoder if index >= len(tokens)]
    if not tokens or (not misplaced and not extra):
        return hf
    state = json.loads(hf.backend_tokenizer.to_str())
    model_vocab = state["model"].get("vocab")
    if not isinstance(model_vocab, dict):
        logger.warning("GGUF tokenizer has misplaced special tokens, but its model kind cannot be repaired")
        return hf
    by_id = {index: token for token, index in model_vocab.items()}
    for index, token, _ in misplaced:
        model_vocab.pop(by_id.get(index, token), None)
        model_vocab[token] = index
    repaired = {token: index for index, token, _ in misplaced}
    added = [entry for entry in state["added_tokens"] if entry["id"] < len(tokens) and entry["content"] not in repaired]
    added += [{"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": special} for index, token, special in misplaced]
    state["added_tokens"] = sorted(added, key=lambda entry: entry["id"])
    _fix_post_processor(state.get("post_processor"), repaired)
    specials = {name: tokens[vocab[f"tokenizer.ggml.{key}_token_id"]]
                for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                  ("pad_token", "padding"))
                if 0 <= vocab.get(f"tokenizer.ggml.{key}_token_id", -1) < len(tokens)}
    backend = BackendTokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=hf.chat_template, **specials)
