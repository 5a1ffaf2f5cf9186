"""An engine request: token ids in, token ids out, and where it stands in the schedule."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pocketllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS or a stop token id (or a stop string, decided by the front end)
    LENGTH = "length"      # max_tokens or the model's context ran out
    CANCELLED = "cancelled"


@dataclass
class Request:
    """State the scheduler and runner share for one sequence.

    ``num_computed_tokens`` counts tokens whose KV is in the cache or being written by a launched step; the
    rest of ``all_token_ids`` (prompt and generated tokens) is still to be prefilled. A launched step that
    samples adds a *pending* token: sampled on the device, not yet read back to ``output_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    # Grammar matcher (runner.grammar.GrammarMatcher) of a structured output, created at add time and
    # advanced once per appended output token.
    grammar: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0   # sampled by a launched step, not yet appended (0 or 1)
    pending_row: int = -1         # that token's row in the launched step's sampled-token tensor
    num_cached_tokens: int = 0
    # Speculative decoding: the most tokens the next verify step proposes (None: the configured number). A step
    # that rejects a proposal shrinks it to what was accepted plus one; one that accepts all grows it by one.
    speculative_window: int | None = None
    # A draft model (engine/draft_proposer.py): tokens before ``num_computed_tokens`` whose KV the draft still
    # lacks (1 after a verify step that kept every proposal: the draft never ran the last one).
    draft_lag: int = 0
    # The speculative proposer's own state for this request (prompt lookup: its n-gram index), dropped with it.
    proposer_state: Any = None
    block_table: list[int] = field(default_factory=list)
    # Leading block-table entries released because every layer's window has passed them (they read 0).
    num_released_blocks: int = 0
    num_hashed_blocks: int = 0
    last_block_hash: int = 0
    state_slot: int = -1      # hybrid models: this request's slot in the recurrent-state pool while running
    # Hybrid models with speculative decoding: the first of this request's checkpoint slots (the state after
    # each position of a verify chunk but the last, so a rejected proposal rolls back to one of them; -1: none).
    state_checkpoints: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus the pending one: where the next chunk of this request ends."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reaches_length_limit(self, max_model_len: int, pending: int = 0) -> bool:
        """Whether the output tokens plus ``pending`` ones not yet read back reach ``max_tokens`` or the
        context (``max_model_len``): the one end-of-budget rule (``max_tokens`` None is the context alone)."""
        outputs = len(self.output_token_ids) + pending
        limit = self.params.max_tokens
        return (limit is not None and outputs >= limit) or len(self.prompt_token_ids) + outputs >= max_model_len
