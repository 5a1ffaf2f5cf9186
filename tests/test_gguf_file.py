"""The GGUF reader and the tokenizer cache: what they give equals what gguf-py and a fresh conversion give."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
from test_loaders import make_quant_gguf

from pocketllm.errors import CheckpointError
from pocketllm.loaders.gguf_dequant import dequantize
from pocketllm.loaders.gguf_file import GGUFFile
from pocketllm.tokenizer import gguf_cache
from pocketllm.tokenizer.tokenizer import Tokenizer


def _same_file_as_gguf_py(path: str) -> None:
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.type.name == theirs.tensor_type.name, mine.name
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape)), mine.name
        assert mine.n_elements == int(theirs.n_elements), mine.name
        want = gguf.quants.dequantize(theirs.data, theirs.tensor_type).reshape(mine.shape)
        np.testing.assert_array_equal(dequantize(mine), want, err_msg=mine.name)


def test_default_model_read_as_gguf_py_reads_it(smollm2_gguf: str) -> None:
    """Metadata (the tokenizer's 49,152 strings included), tensor names, shapes, types and values."""
    _same_file_as_gguf_py(smollm2_gguf)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_every_supported_type_read_as_gguf_py_reads_it(arch: str, tmp_path) -> None:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the k-quants, F16, BF16, F32 and stacked experts."""
    _same_file_as_gguf_py(make_quant_gguf(tmp_path, arch))


def test_damaged_files_are_refused(tmp_path) -> None:
    path = make_quant_gguf(tmp_path, "llama")
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="runs past the end"):
        GGUFFile(str(truncated))
    cut_in_metadata = tmp_path / "cut.gguf"
    cut_in_metadata.write_bytes(data[:40])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFFile(str(cut_in_metadata))
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match="no GGUF magic"):
        GGUFFile(str(not_gguf))
    with pytest.raises(CheckpointError, match="cannot read"):
        GGUFFile(str(tmp_path / "missing.gguf"))


def _assert_same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    texts = ["Hello world", "<|im_start|>user\nhi<|im_end|>\n", " leading space", "ünïcödé 日本語 🙂",
             "<|endoftext|>x", "a\n\n\tb  c"]
    for text in texts:
        for special in (True, False):
            assert a.encode(text, special) == b.encode(text, special), (text, special)
    ids = list(range(0, a.vocab_size, 97))
    assert a.decode(ids) == b.decode(ids) and a.decode(ids, False) == b.decode(ids, False)
    for name in ("chat_template", "bos_token", "eos_token", "bos_token_id", "eos_token_id", "vocab_size",
                 "special_token_ids", "add_bos_token"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.vocab_bytes() == b.vocab_bytes()


def test_tokenizer_cache_gives_the_converted_tokenizer(smollm2_gguf: str, tmp_path, monkeypatch) -> None:
    """The first load converts and stores; the second loads the entry and behaves identically; a file that
    changes gets a new entry."""
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, model)
    assert gguf_cache.load(str(model)) is None
    converted = Tokenizer.from_gguf(str(model))
    entry = gguf_cache.entry_dir(str(model))
    assert (entry / "tokenizer.json").is_file()
    assert gguf_cache.load(str(model)) is not None
    _assert_same_tokenizer(converted, Tokenizer.from_gguf(str(model)))
    os.utime(model, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache.entry_dir(str(model)) != entry and gguf_cache.load(str(model)) is None


def test_damaged_tokenizer_cache_entry_is_converted_again(smollm2_gguf: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path / "cache"))
    converted = Tokenizer.from_gguf(smollm2_gguf)
    (gguf_cache.entry_dir(smollm2_gguf) / "tokenizer.json").write_text("{not json")
    _assert_same_tokenizer(converted, Tokenizer.from_gguf(smollm2_gguf))


def test_tokenizer_cache_keeps_the_newest_entries(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf_tokenizers"
    for index in range(gguf_cache.KEEP + 3):
        (root / f"entry{index:02d}").mkdir(parents=True)
        os.utime(root / f"entry{index:02d}", (index, index))
    gguf_cache._prune(root)
    assert sorted(p.name for p in root.iterdir()) == [f"entry{i:02d}" for i in range(3, gguf_cache.KEEP + 3)]
