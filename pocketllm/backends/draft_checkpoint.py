"""The draft checkpoint of speculative ``method="draft_model"``: loaded beside the target's and refused unless it
shares the target's vocabulary and tokenizer."""

from __future__ import annotations

import os

from pocketllm.config import EngineArgs
from pocketllm.engine.draft_proposer import DraftModel
from pocketllm.errors import InvalidRequestError
from pocketllm.loaders.checkpoint import Checkpoint, load_checkpoint


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"speculative_config.model: {message}", param="speculative_config")


def check_same_tokenizer(target: Checkpoint, draft: Checkpoint) -> None:
    """Refuse a draft whose vocabulary size, or whose tokenizer (token to id, where both checkpoints have one),
    differs from the target's: its proposals would be other tokens than the target scores."""
    draft_vocab, vocab = int(draft.hf_config.vocab_size), int(target.hf_config.vocab_size)
    if draft_vocab != vocab:
        raise _refuse(f"the draft's vocabulary has {draft_vocab} tokens and the target's {vocab}; a draft model "
                      "needs the target's tokenizer")
    if os.path.abspath(draft.path) == os.path.abspath(target.path):
        return
    mine, theirs = target.tokenizer, draft.tokenizer
    if mine is None or theirs is None:
        return
    ours, others = mine.hf.get_vocab(), theirs.hf.get_vocab()
    if ours != others:
        differing = sorted(set(ours.items()) ^ set(others.items()), key=lambda item: item[1])
        token, index = differing[0]
        raise _refuse(f"the draft's tokenizer differs from the target's ({len(differing)} token/id pairs differ, "
                      f"e.g. {token!r} as id {index}); a draft model needs the target's tokenizer")


def load_draft(args: EngineArgs, target: Checkpoint) -> DraftModel | None:
    """The draft model ``args.speculative_config`` names, checked against ``target`` (None for other methods)."""
    spec = args.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    # The target's tokenizer first: it may still be loading on a thread of its own, and a second checkpoint's
    # first import of transformers beside that load can find the package half imported.
    target.tokenizer_loading.result()
    checkpoint = load_checkpoint(spec.model, args.load_format)
    check_same_tokenizer(target, checkpoint)
    dummy = args.load_format == "dummy" or checkpoint.format == "dummy"
    return DraftModel(checkpoint.hf_config, None if dummy else checkpoint.iter_weights(), checkpoint.weight_type)
