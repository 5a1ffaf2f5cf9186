"""Vocabulary-parallel token embedding and language-model head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from pocketllm.layers.float8_weight import Float8Weight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded[self.start:self.start + self.shard_size]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(Float8Weight, VocabParallelEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered from every rank); ``quantize_fp8``
    gives it codes of its own, so a tied embedding keeps its rows for lookups."""

    # What comes before the head: the model's final norm, which ``forward_normed`` runs in the product's
    # kernel up to ``fused_rows`` rows.
    prologue = "rms_norm"
    # CUDA, set by the model runner after timing on this weight: rows up to which the skinny Triton kernel
    # replaces F.linear (0 = never) and up to which the final norm runs fused into it, and the one-row launch
    # settings timed fastest, plain and fused (None: untimed).
    skinny_rows = 0
    fused_rows = 0
    one_row = None
    fused_one_row = None

    @property
    def logits_dtype(self) -> torch.dtype:
        """The dtype of the logits (the compute dtype, also for float8 weights)."""
        return self.compute_dtype or self.weight.dtype

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(out)[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``hidden``; without tensor parallelism they can be written into ``out`` (a CUDA graph's
        static buffer)."""
        if out is not None and self.tp_size != 1:
            raise ValueError("an output buffer for the logits needs a single rank")
        if hidden.dim() == 2 and 0 < hidden.shape[0] <= self.skinny_rows and hidden.is_cuda:
            from pocketllm.kernels.gemv import skinny_linear

            return self._logits(skinny_linear(hidden, self.weight, self.one_row, out, self.weight_scale))
        if self.weight_scale is not None:
            from pocketllm.kernels.fp8 import scaled_product

            logits = scaled_product(hidden, self.weight, self.weight_scale)
            return self._logits(logits) if out is None else out.copy_(logits)
        if out is not None:
            return torch.matmul(hidden, self.weight.t(), out=out)
        return self._logits(F.linear(hidden, self.weight))

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the final norm runs fused into this head's kernel for ``x``."""
        return x.dim() == 2 and 0 < x.shape[0] <= self.fused_rows and x.is_cuda

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``norm(x + residual)``, in one kernel where ``fuses``."""
        if not self.fuses(x):
            return self(norm(x, residual)[0], out)
        from pocketllm.kernels.gemv import skinny_rms_norm_linear

        logits, _ = skinny_rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, norm.offset,
                                           self.fused_one_row, out, self.weight_scale)
        return self._logits(logits)
