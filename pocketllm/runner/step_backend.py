"""How the model runner runs one step: step backends, kept in an ordered list by the model runner; the first that
handles a step's chunks runs it and returns the logits of its sampling rows.

``CpuDecodeBackend`` (the decode rows and verify chunks of CPU steps of a model that exports a decode plan,
``cpu_decode.py``; a step's prompt chunks go to the host-batch step beside them) comes first where it is set up.
Last comes one ``HostBatchStep``, which handles every step: ``CudaGraphStep`` (the Triton kernel metadata and the
decode CUDA graphs of ``cuda_graphs.py``) on CUDA with Triton, else
``ReferenceStep`` (the PyTorch reference forward). A host-batch step gathers the chunks into one ``HostBatch``,
which rank 0 of a tensor-parallel group sends to the other ranks before it runs the step; a worker runs what
it receives through the same step's ``run``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pocketllm.distributed.step_channel import StepChannel
from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.host_batch import HostBatch, gather_host_batch
from pocketllm.step.host_to_device import device_tensor
from pocketllm.step.scheduled_chunk import ScheduledChunk

if TYPE_CHECKING:
    from pocketllm.runner.cpu_decode import CpuDecodeStep
    from pocketllm.runner.cuda_graphs import CudaStepRunner


class StepBackend(ABC):
    """One way of running a step of the model."""

    @abstractmethod
    def handles(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this backend runs a step of ``chunks``."""

    @abstractmethod
    def launch(self, chunks: list[ScheduledChunk], previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Queue the step; the logits of its sampling rows (None if no chunk samples). A chunk whose last input
        is still pending takes it from ``previous_tokens`` (the previous step's sampled tokens, on the device)."""


class HostBatchStep(StepBackend):
    """A step over the host batch of its chunks; handles every step. ``step_channel`` (rank 0 of several):
    where the host batch is sent before the step runs."""

    def __init__(self, block_size: int, step_channel: StepChannel | None) -> None:
        self.block_size = block_size
        self.step_channel = step_channel

    def handles(self, chunks: list[ScheduledChunk]) -> bool:
        return True

    def launch(self, chunks: list[ScheduledChunk], previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        host = gather_host_batch(chunks, self.block_size)
        if self.step_channel is not None:
            self.step_channel.send(host)
        return self.run(host, previous_tokens)

    @abstractmethod
    def run(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of the host batch's sampling rows (None if none)."""


class ReferenceStep(HostBatchStep):
    """The PyTorch reference forward (the test oracle), over attention layers bound to the reference backend."""

    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 step_channel: StepChannel | None, has_state: bool) -> None:
        super().__init__(block_size, step_channel)
        self.model = model
        self.device = device
        self.has_state = has_state   # hybrid models: sequences carry a recurrent-state slot

    def tensors(self, host: HostBatch, previous_tokens: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The device tensors of a host batch (block tables padded with 0): token ids, positions, metadata."""
        device = self.device
        width = max(len(t) for t in host.tables)
        tables = [t + [0] * (width - len(t)) for t in host.tables]
        state = {}
        # (Through pinned memory: a step launched while another runs, or a drafter's chained forward, does not
        # make the host wait for the device.)
        if self.has_state:
            state = {"state_slots": device_tensor(host.state_slots, torch.int64, device),
                     "state_slots_host": host.state_slots}
            if any(c >= 0 for c in host.state_checkpoints):
                state["state_checkpoints_host"] = host.state_checkpoints
        meta = AttentionMetadata(
            slot_mapping=device_tensor(host.slots, torch.int64, device),
            block_tables=device_tensor(tables, torch.int64, device),
            query_start=host.query_start, context_lens=host.context_lens, block_size=self.block_size, **state)
        ids = device_tensor(host.input_ids, torch.int64, device)
        host.pending.fill(ids, previous_tokens)
        return ids, device_tensor(host.positions, torch.int64, device), meta

    def sampled_hidden(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states (after the final norm) of the host batch's sampling rows (None if none)."""
        ids, positions, meta = self.tensors(host, previous_tokens)
        hidden = self.model(ids, positions, meta)
        if not host.sample_index:
            return None
        return hidden.index_select(0, torch.tensor(host.sample_index, dtype=torch.int64, device=self.device))

    def run(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        hidden = self.sampled_hidden(host, previous_tokens)
        return None if hidden is None else self.model.compute_logits(hidden)


class CudaGraphStep(HostBatchStep):
    """The CUDA step (``cuda_graphs.py``): kernel metadata from one pinned copy, decode steps replayed from
    CUDA graphs; over attention layers bound to the Triton backend."""

    def __init__(self, cuda_step: CudaStepRunner, block_size: int, step_channel: StepChannel | None) -> None:
        super().__init__(block_size, step_channel)
        self.cuda_step = cuda_step

    def run(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.cuda_step.forward(host, previous_tokens)


class CpuDecodeBackend(StepBackend):
    """The CPU decode step (``cpu_decode.py``) for the decode rows and verify chunks it handles; the LM head from
    the model. In a step that also holds prompt chunks, those run on ``rest`` (the host-batch step) and the
    decode rows here still: a sequence's tokens then come from the same kernels whatever else its steps hold
    (with the whole step on the reference forward, a prompt arriving beside a decoding request changed that
    request's rounding and, at times, its greedy tokens)."""

    def __init__(self, step: CpuDecodeStep, model: torch.nn.Module, rest: StepBackend) -> None:
        self.step = step
        self.model = model
        self.rest = rest

    def _split(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """The chunks the decode step would run on their own, and the others."""
        mine, others = [], []
        for chunk in chunks:
            (mine if self.step.handles([chunk]) else others).append(chunk)
        return mine, others

    def handles(self, chunks: list[ScheduledChunk]) -> bool:
        if self.step.handles(chunks):
            return True
        mine, others = self._split(chunks)
        return bool(mine) and bool(others) and self.step.handles(mine) and self.rest.handles(others)

    def _logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        hidden = self.step.forward(chunks)
        return None if hidden is None else self.model.compute_logits(hidden)

    def launch(self, chunks: list[ScheduledChunk], previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        if self.step.handles(chunks):
            return self._logits(chunks)
        mine, others = self._split(chunks)
        return in_chunk_order(chunks, mine, self._logits(mine), self.rest.launch(others, previous_tokens))


def sampling_rows(chunk: ScheduledChunk) -> int:
    """How many logits rows a chunk has: a verify chunk's 1 + k, one for another sampling chunk, else none."""
    return len(chunk.draft) + 1 if chunk.samples else 0


def in_chunk_order(chunks: list[ScheduledChunk], mine: list[ScheduledChunk], fast: torch.Tensor | None,
                   rest: torch.Tensor | None, rows: Callable[[ScheduledChunk], int] = sampling_rows
                   ) -> torch.Tensor | None:
    """The rows of a step whose chunks ran on two backends, ``fast`` those of ``mine`` and ``rest`` the others',
    in the step's chunk order: each chunk's ``rows`` (by default its logits rows), in turn, taken from the fast
    rows or from the rest's."""
    if fast is None or rest is None:
        return fast if rest is None else rest
    ours = {id(chunk) for chunk in mine}
    fast_rows, rest_rows = iter(range(fast.shape[0])), iter(range(fast.shape[0], fast.shape[0] + rest.shape[0]))
    order = [next(fast_rows if id(chunk) in ours else rest_rows) for chunk in chunks for _ in range(rows(chunk))]
    dtype = torch.promote_types(fast.dtype, rest.dtype)
    joined = torch.cat([fast.to(dtype), rest.to(dtype)])
    return joined.index_select(0, device_tensor(order, torch.int64, joined.device))
