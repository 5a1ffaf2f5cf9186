"""What a backend declares it can do; the protocol layer checks requests against it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineCaps:
    max_slots: int
    continuous_batching: bool = True
    chunked_prefill: bool = True
    paged_kv: bool = True
    prefix_caching: bool = True
    per_request_sampling: bool = True
    per_request_top_k: bool = True
    logprobs: bool = True
    max_logprobs: int = 20
    penalties: bool = True
    logit_bias: bool = True
    structured_outputs: bool = False
    speculative: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
