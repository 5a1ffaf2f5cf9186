"""Tokenizer wrapper (HF directories and GGUF files) and end-of-sequence resolution."""

from pocketllm.tokenizer.eos import resolve_eos
from pocketllm.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "resolve_eos"]
