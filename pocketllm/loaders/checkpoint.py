"""One entry point for every checkpoint kind: GGUF file, HF safetensors directory, dummy preset."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pocketllm.errors import CheckpointError, InvalidRequestError
from pocketllm.loaders import dummy, gguf_loader, hf_loader

if TYPE_CHECKING:
    from pocketllm.tokenizer.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class WeightSource(Protocol):
    """Where a checkpoint's tensors come from."""

    def count(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class NoWeights:
    """The weight source of dummy checkpoints: nothing (the model keeps its random init)."""

    def count(self) -> int:
        """Always zero."""
        return 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


@dataclass(frozen=True)
class Checkpoint:
    """A located checkpoint: its config, generation defaults, tokenizer and a lazy weight stream.

    ``tokenizer_loading`` is the tokenizer, or its load still running on a thread of its own (a GGUF file's:
    ``tokenizer`` waits for it), so that the caller can load weights meanwhile. ``weight_type``: how the file
    stores most of its layers' matrices, as a GGML type name (``"Q4_1"``) for a GGUF file; None for float
    checkpoints (safetensors) and dummy weights."""

    path: str
    format: str
    hf_config: Any
    generation_config: dict
    tokenizer_loading: Future = field(repr=False, compare=False)
    weight_source: WeightSource = field(default_factory=NoWeights, repr=False, compare=False)
    weight_type: str | None = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer (None for a checkpoint without one); raises what loading it raised."""
        return self.tokenizer_loading.result()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs, with a "Loading weights" progress bar on stderr."""
        from tqdm.auto import tqdm

        total = self.weight_source.count()
        if total == 0:
            return
        with tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
            for name, tensor in self.weight_source:
                yield name, tensor
                bar.update(1)


def _pickle_error(path: str) -> CheckpointError:
    return CheckpointError(
        f"{path!r} is a pickle checkpoint (.bin/.pt/.pth/.ckpt); pickle formats are refused for safety because "
        "loading them can run arbitrary code. Convert the checkpoint to safetensors (e.g. load it once in a "
        "trusted environment and save_pretrained(..., safe_serialization=True)) or use a GGUF file.")


def _detect_format(path: str, load_format: str) -> str:
    """The concrete format of an existing path, refusing pickle files and format mismatches."""
    if os.path.isfile(path):
        lower = path.lower()
        if lower.endswith(PICKLE_SUFFIXES):
            raise _pickle_error(path)
        if load_format == "gguf" or (load_format == "auto" and lower.endswith(".gguf")):
            return "gguf"
        raise CheckpointError(f"{path!r} is not a checkpoint PocketLLM reads as {load_format!r}: give a .gguf file "
                              "or a Hugging Face directory with config.json and *.safetensors")
    names = os.listdir(path)
    if any(name.endswith(".safetensors") for name in names) and load_format in ("auto", "safetensors"):
        return "safetensors"
    ggufs = [name for name in names if name.lower().endswith(".gguf")]
    if len(ggufs) == 1 and load_format in ("auto", "gguf"):
        return "gguf"
    if any(name.lower().endswith(PICKLE_SUFFIXES) for name in names):
        raise _pickle_error(path)
    wanted = "safetensors weights" if load_format != "gguf" else "exactly one .gguf file"
    raise CheckpointError(f"{path!r} holds no {wanted} (found: {sorted(names)[:10]})")


def _gguf_file(path: str) -> str:
    if os.path.isdir(path):
        return os.path.join(path, next(n for n in os.listdir(path) if n.lower().endswith(".gguf")))
    return path


def _done(value: Tokenizer | None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _in_background(load: Callable[[], Tokenizer | None]) -> Future:
    """``load()`` run on a daemon thread; its result (or exception) in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(load())
        except BaseException as exc:   # handed to whoever asks for the tokenizer
            future.set_exception(exc)

    threading.Thread(target=run, name="pocketllm-tokenizer", daemon=True).start()
    return future


def _hf_tokenizer(directory: str) -> Tokenizer:
    from pocketllm.tokenizer.tokenizer import Tokenizer

    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise CheckpointError(f"{directory!r} has no tokenizer files ({' or '.join(TOKENIZER_FILES)})")
    return Tokenizer.from_checkpoint_dir(directory)


def _gguf_tokenizer(reader: Any, path: str) -> Tokenizer | None:
    from pocketllm.tokenizer.tokenizer import Tokenizer

    if "tokenizer.ggml.model" not in reader.metadata:
        return None
    return Tokenizer.from_gguf(path)


def _load_gguf(path: str, model: str, with_weights: bool = True, with_tokenizer: bool = True) -> Checkpoint:
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.build_config(reader)
    weights = gguf_loader.GGUFWeights(reader, config) if with_weights else NoWeights()
    tokenizer = _in_background(lambda: _gguf_tokenizer(reader, path)) if with_tokenizer else _done(None)
    return Checkpoint(path=model, format="gguf" if with_weights else "dummy", hf_config=config,
                      generation_config={}, tokenizer_loading=tokenizer, weight_source=weights,
                      weight_type=gguf_loader.linear_weight_type(reader) if with_weights else None)


def _load_safetensors(directory: str, with_tokenizer: bool = True) -> Checkpoint:
    config = hf_loader.load_hf_config(directory)
    weights = hf_loader.SafetensorsWeights(hf_loader.safetensors_files(directory))
    return Checkpoint(path=directory, format="safetensors", hf_config=config,
                      generation_config=hf_loader.read_generation_config(directory),
                      tokenizer_loading=_done(_hf_tokenizer(directory) if with_tokenizer else None),
                      weight_source=weights)


def _load_dummy(model: str) -> Checkpoint:
    if model in dummy.PRESETS:
        return Checkpoint(path=model, format="dummy", hf_config=dummy.preset_config(model),
                          generation_config={}, tokenizer_loading=_done(None))
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        tokenizer = _hf_tokenizer(model) if any(
            os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES) else None
        return Checkpoint(path=model, format="dummy", hf_config=hf_loader.load_hf_config(model),
                          generation_config=hf_loader.read_generation_config(model),
                          tokenizer_loading=_done(tokenizer))
    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        return _load_gguf(model, model, with_weights=False)
    raise CheckpointError(f"load_format='dummy' needs a preset ({', '.join(dummy.preset_names())}), "
                          f"a directory with config.json or a .gguf file; got {model!r}")


def load_checkpoint(model: str, load_format: str = "auto", with_tokenizer: bool = True) -> Checkpoint:
    """Locate and open a checkpoint; weights are read only when ``iter_weights`` is iterated. Without
    ``with_tokenizer`` (a tensor-parallel worker rank) a GGUF or safetensors checkpoint loads no tokenizer."""
    if load_format not in LOAD_FORMATS:
        raise InvalidRequestError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}", param="load_format")
    model = os.fspath(model)
    if load_format == "dummy":
        return _load_dummy(model)
    if not os.path.exists(model):
        hint = " (dummy presets need load_format='dummy')" if model in dummy.PRESETS else ""
        raise CheckpointError(f"checkpoint {model!r} does not exist{hint}")
    kind = _detect_format(model, load_format)
    if kind == "gguf":
        return _load_gguf(_gguf_file(model), model, with_tokenizer=with_tokenizer)
    return _load_safetensors(model, with_tokenizer)
