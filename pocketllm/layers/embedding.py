"""Vocabulary-parallel token embedding and language-model head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


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


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered from every rank)."""

    # CUDA: rows up to which the skinny Triton kernel replaces F.linear (0 = never; the model runner sets it
    # after timing both on this weight), and the kernel's one-row launch settings timed fastest (None: untimed).
    skinny_rows = 0
    one_row = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 2 and 0 < hidden.shape[0] <= self.skinny_rows and hidden.is_cuda:
            from pocketllm.kernels.gemv import skinny_linear

            return all_gather_last_dim(skinny_linear(hidden, self.weight, self.one_row))[..., : self.vocab_size]
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
