"""What a step sampled: one :class:`SampledToken` per row on the host, or a :class:`SampleResult` still on the
device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pocketllm.sampling_params import SamplingParams


@dataclass
class SampledToken:
    """The token chosen for one row, with its raw log-probability and ranked alternatives."""

    token_id: int
    # Log-prob of the sampled token under the RAW distribution (None if params.logprobs is None).
    logprob: float | None = None
    # params.logprobs alternatives ranked from raw logits (empty if 0/None).
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class SampleResult:
    """A batch's sampled tokens as device tensors (queued, not yet read); ``to_host`` waits and reads them."""

    tokens: torch.Tensor                        # [B] int64, on the logits' device
    params: list[SamplingParams]
    lp_rows: list[int] = field(default_factory=list)           # rows that asked for log-probabilities
    picked: torch.Tensor | None = None          # [len(lp_rows)] raw log-prob of each such row's token
    top: tuple[torch.Tensor, torch.Tensor] | None = None       # ([len(lp_rows), k] values, ids)
    # CUDA: pinned host copies queued right behind the sampling, and the event that marks them done.
    _host: list[torch.Tensor | None] | None = None
    _ready: Any = None

    def start_copy(self) -> SampleResult:
        """CUDA: queue the copies to pinned host memory now, so that ``to_host`` waits only for this step and
        not for work queued after it (a plain ``tolist`` would wait for the whole stream)."""
        if not self.tokens.is_cuda:
            return self
        tensors = [self.tokens, self.picked, *(self.top or (None, None))]
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, device in zip(self._host, tensors):
            if host is not None:
                host.copy_(device, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()
        return self

    def to_host(self) -> list[SampledToken]:
        """One :class:`SampledToken` per row (waits for this step's sampling only once ``start_copy`` ran)."""
        if self._host is not None:
            self._ready.synchronize()
            tokens, picked_t, top_vals_t, top_ids_t = self._host
        else:
            tokens, picked_t = self.tokens, self.picked
            top_vals_t, top_ids_t = self.top if self.top is not None else (None, None)
        token_list = tokens.tolist()
        picked = picked_t.tolist() if picked_t is not None else []
        top_vals, top_ids = (top_vals_t.tolist(), top_ids_t.tolist()) if top_vals_t is not None else ([], [])
        lp_pos = {row: j for j, row in enumerate(self.lp_rows)}
        out: list[SampledToken] = []
        for i, p in enumerate(self.params):
            token = SampledToken(int(token_list[i]))
            if p.logprobs is not None:
                j = lp_pos[i]
                token.logprob = float(picked[j])
                n = p.logprobs
                if n > 0:
                    token.top_ids = [int(t) for t in top_ids[j][:n]]
                    token.top_logprobs = [float(v) for v in top_vals[j][:n]]
            out.append(token)
        return out
