"""Tokenizer wrapper (GGUF and HF directories, chat templates, token bytes) and EOS resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.tokenizer import Tokenizer, resolve_eos

TEXTS = [
    "Hello, world!", "", " leading and trailing spaces ", "tabs\tand\nnew\n\nlines\r\n", "naïve café — “quotes”",
    "日本語のテキストと中文", "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷", "<|im_start|>user\nHi<|im_end|>\n",
    "numbers 1234567890 3.14159 -42", "code: def f(x):\n    return x**2  # comment", "   ", "a" * 300,
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: str) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smol_reference(tiny_checkpoint):
    """The SmolLM2 tokenizer as AutoTokenizer loads it from saved tokenizer files.

    Not from the qwen2 checkpoint: there AutoTokenizer follows config.json's model_type to Qwen2Tokenizer,
    which swaps in Qwen2's pre-tokenizer regex (so "\\n\\n" becomes one token).
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"), local_files_only=True)


# ---------------------------------------------------------------- SmolLM2 (GGUF)


def test_smollm2_encode_matches_transformers(smol: Tokenizer, smol_reference) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert smol.encode(text, add_special_tokens=special) == smol_reference(
                text, add_special_tokens=special)["input_ids"], text


def test_smollm2_attributes(smol: Tokenizer, smollm2_hf_tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token, smol.bos_token_id, smol.eos_token, smol.eos_token_id) == (
        "<|im_start|>", 1, "<|im_end|>", 2)
    assert smol.add_bos_token is False
    assert {0, 1, 2} <= smol.special_token_ids
    assert smol.chat_template == smollm2_hf_tokenizer.chat_template  # GGUF tokenizer.chat_template
    assert smol.chat_template.startswith("{% for message in messages %}")


def test_token_bytes_rebuild_utf8(smol: Tokenizer) -> None:
    for text in TEXTS:
        ids = smol.encode(text, add_special_tokens=False)
        assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    (emoji,) = [smol.encode("😀", add_special_tokens=False)]
    assert len(emoji) > 1 and b"".join(smol.token_bytes(i) for i in emoji) == "😀".encode()
    assert smol.token_bytes(1) == b"<|im_start|>"
    assert smol.token_bytes(smol.encode("\n", add_special_tokens=False)[0]) == b"\n"


def test_token_text_and_decode(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>assistant\nParis is nice.<|im_end|>")
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nParis is nice.<|im_end|>"
    assert smol.decode(ids) == "assistant\nParis is nice."
    assert smol.token_text(2) == "<|im_end|>"
    word = smol.encode(" Paris", add_special_tokens=False)
    assert [smol.token_text(i) for i in word] == [smol.decode([i]) for i in word]
    assert "".join(smol.token_text(i) for i in word) == " Paris"


def test_decode_equals_the_hf_tokenizer(smol: Tokenizer) -> None:
    """Decoding goes through the Rust tokenizer directly where that gives the HF wrapper's text."""
    assert smol._backend is not None
    for text in TEXTS:
        ids = smol.encode(text)
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == smol.hf.decode(ids, skip_special_tokens=skip)


def test_decode_keeps_the_hf_clean_up_of_spaces() -> None:
    """A tokenizer whose HF decode cleans up spaces (WordPiece) keeps decoding through HF."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[CLS]", "do", "n't", ",", "say", "it", "'", "s", "so", "?", "(", "ok", ")", ".", "Do"]
    rust = RustTokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rust.decoder = decoders.WordPiece(cleanup=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    tok = Tokenizer(hf)
    ids = tok.encode("do n't , ok .", add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids)
    if hf.decode(ids) != rust.decode(ids):   # this transformers version cleans up: the wrapper must be kept
        assert tok._backend is None


def test_out_of_range_token(smol: Tokenizer) -> None:
    for bad in (-1, 49152, True):
        with pytest.raises(InvalidRequestError):
            smol.token_bytes(bad)


def test_vocab_bytes(smol: Tokenizer) -> None:
    table = smol.vocab_bytes()
    assert len(table) == 49152 and table[2] == b"<|im_end|>"
    singles = [b for b in table if len(b) == 1]
    assert len(singles) == len(set(singles)) > 200  # byte tokens map back to distinct bytes


@pytest.mark.parametrize("text", ["", "a", "Hello, world!", " " * 5000, "\n" + " " * 80, "#" * 800,
                                  "<|im_start|>user\nhi<|im_end|>" * 20, "héllo 日本語 🙂 " * 50,
                                  "\n" * 300 + "x" * 300])
def test_min_tokens_is_a_lower_bound(smol: Tokenizer, text: str) -> None:
    assert smol.max_token_bytes == max(len(piece) for piece in smol.vocab_bytes())
    least = smol.min_tokens(text)
    assert least <= len(smol.encode(text, add_special_tokens=False))
    assert least == -(-len(text.encode()) // smol.max_token_bytes)


def test_min_tokens_is_zero_where_no_bound_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_sentencepiece_gguf(path)   # not byte-level
    tok = Tokenizer.from_gguf(str(path))
    assert tok.max_token_bytes is None and tok.min_tokens("hello " * 100) == 0


# ---------------------------------------------------------------- HF directories and chat templates


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_dir_tokenizer(arch: str, tiny_checkpoint, smol: Tokenizer) -> None:
    from transformers import AutoTokenizer

    directory = tiny_checkpoint(arch)
    tok = Tokenizer.from_checkpoint_dir(directory)
    reference = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert tok.vocab_size == 49152 and tok.chat_template == smol.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    for text in TEXTS:
        assert tok.encode(text) == reference(text)["input_ids"], text


def _tokenizer_dir(source: str, target: Path, config_extra: dict) -> Path:
    """A directory with ``source``'s tokenizer.json and a tokenizer_config.json carrying ``config_extra``."""
    target.mkdir()
    shutil.copy(Path(source) / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((Path(source) / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **config_extra}))
    return target


def test_chat_template_sources(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint("qwen2")
    as_string = _tokenizer_dir(source, tmp_path / "string", {"chat_template": "T1 {{ messages }}"})
    assert Tokenizer.from_checkpoint_dir(str(as_string)).chat_template == "T1 {{ messages }}"
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    as_list = _tokenizer_dir(source, tmp_path / "list", {"chat_template": listed})
    assert Tokenizer.from_checkpoint_dir(str(as_list)).chat_template == "DEFAULT"
    as_file = _tokenizer_dir(source, tmp_path / "file", {})
    (as_file / "chat_template.jinja").write_text("FROM FILE")
    assert Tokenizer.from_checkpoint_dir(str(as_file)).chat_template == "FROM FILE"
    none = _tokenizer_dir(source, tmp_path / "none", {})
    assert Tokenizer.from_checkpoint_dir(str(none)).chat_template is None


def test_qwen2_fixture_dir_adds_bos_despite_config_flag(r1_tokenizer) -> None:
    from transformers import AutoTokenizer

    r1_dir = r1_tokenizer.directory
    assert "add_bos_token" not in json.loads((r1_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_checkpoint_dir(str(r1_dir))
    reference = AutoTokenizer.from_pretrained(str(r1_dir), local_files_only=True)
    assert tok.add_bos_token is True  # the post-processor adds BOS although add_bos_token is not set
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.chat_template == (r1_dir / "chat_template.jinja").read_text()
    for text in TEXTS + ["<think>\nreasoning\n</think>\n\nanswer <tool_call>{}</tool_call>"]:
        assert tok.encode(text) == reference(text)["input_ids"], text
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text, False)) == text.encode(), text


# ---------------------------------------------------------------- GGUF special-token repair


def test_gguf_non_ascii_special_tokens_keep_their_ids(r1_tokenizer) -> None:
    """transformers maps DeepSeek's <｜begin▁of▁sentence｜> past the vocabulary; we keep the GGUF ids."""
    from transformers import AutoTokenizer
    from transformers.integrations.gguf import read_gguf_metadata

    gguf_path, tokens = str(r1_tokenizer.gguf), r1_tokenizer.tokens
    bos, eos = tokens.index("<｜begin▁of▁sentence｜>"), tokens.index("<｜end▁of▁sentence｜>")
    user, assistant, think = tokens.index("<｜User｜>"), tokens.index("<｜Assistant｜>"), tokens.index("<think>")
    plain = AutoTokenizer.from_pretrained(str(r1_tokenizer.directory), local_files_only=True)  # same merges
    assert plain.bos_token_id >= len(tokens)  # the transformers conversion this repairs
    tok = Tokenizer.from_gguf(gguf_path)
    fields, _ = read_gguf_metadata(gguf_path)
    assert tok.vocab_size == fields["tokenizer.ggml.tokens"] == len(tokens)  # (the reader gives the count)
    assert tok.bos_token_id == fields["tokenizer.ggml.bos_token_id"] == bos
    assert tok.eos_token_id == fields["tokenizer.ggml.eos_token_id"] == eos
    assert tok.add_bos_token is True
    hi = plain("hi", add_special_tokens=False)["input_ids"]
    assert "".join(tokens[i] for i in hi) == "hi"
    assert tok.encode("<｜User｜>hi<｜Assistant｜>") == [bos, user, *hi, assistant]
    assert tok.decode([bos, user, *hi], skip_special_tokens=False) == "<｜begin▁of▁sentence｜><｜User｜>hi"
    assert tok.token_bytes(user) == "<｜User｜>".encode()
    assert {bos, eos, user, assistant} <= tok.special_token_ids
    assert tok.encode("<think>x</think>", add_special_tokens=False)[0] == think
    assert tok.chat_template == fields["tokenizer.chat_template"]
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == plain(text, add_special_tokens=False)["input_ids"]


def _write_sentencepiece_gguf(path: Path) -> None:
    """A tiny llama-style (SentencePiece, byte fallback) vocabulary in a GGUF file."""
    import gguf

    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo",
             "▁wor", "▁worl", "▁world", "ll", "lo"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *words, "<|user|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))] + [0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words) + [3])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    _write_sentencepiece_gguf(path)
    tok = Tokenizer.from_gguf(str(path))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert tok.add_bos_token is True and tok.bos_token_id == 1 and tok.vocab_size == 280
    for text in ["hello world", " hello  world", "héllo", "<|user|>hello", "", "x\ny"]:
        assert tok.encode(text) == reference(text)["input_ids"], text
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids).lstrip(b" ") == text.lstrip(" ").encode(), text
    assert tok.token_bytes(3 + 0xC3) == b"\xc3"  # <0xC3>
    assert tok.token_bytes(tok.encode("hello", False)[0]) == b" hello"  # ▁ is a space


# ---------------------------------------------------------------- EOS resolution


def _config(eos):
    return SimpleNamespace(eos_token_id=eos)


def test_resolve_eos_order() -> None:
    tok = SimpleNamespace(eos_token_id=7)
    assert resolve_eos({"eos_token_id": 5}, {"eos_token_id": 6}, _config(8), tok) == (frozenset({5}), "backend_options")
    assert resolve_eos({"eos_token_id": [5, 9]}, {}, _config(8), tok) == (frozenset({5, 9}), "backend_options")
    assert resolve_eos({}, {"eos_token_id": [6, 10]}, _config(8), tok) == (frozenset({6, 10}), "generation_config")
    assert resolve_eos({}, {}, _config(8), tok) == (frozenset({8}), "config")
    assert resolve_eos({}, {"eos_token_id": None}, _config([8, 11]), tok) == (frozenset({8, 11}), "config")
    assert resolve_eos({}, {}, _config(None), tok) == (frozenset({7}), "tokenizer")
    assert resolve_eos({}, {}, None, None) == (frozenset(), "none")
    assert resolve_eos({}, {}, _config(None), SimpleNamespace(eos_token_id=None)) == (frozenset(), "none")


@pytest.mark.parametrize("bad", [True, 2.0, "2", None, [], [1, "2"], [1, True], {"id": 2}])
def test_resolve_eos_rejects_non_integers(bad) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        resolve_eos({"eos_token_id": bad}, {"eos_token_id": 2}, _config(2), None)
    assert excinfo.value.param == "eos_token_id"


def test_resolve_eos_with_real_checkpoint(tiny_checkpoint) -> None:
    from pocketllm.loaders import load_checkpoint

    ckpt = load_checkpoint(tiny_checkpoint("qwen3"))
    assert resolve_eos({}, ckpt.generation_config, ckpt.hf_config, ckpt.tokenizer) == (
        frozenset({2}), "generation_config")
