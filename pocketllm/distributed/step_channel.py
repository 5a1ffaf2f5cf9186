"""Rank 0 → workers: each step's batch as a fixed header plus one flat int64 payload (both in host memory), or
a stop message."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pocketllm.distributed import lost_rank_is_fatal
from pocketllm.distributed.group import step_group
from pocketllm.runner.attention_metadata import AttentionMetadata
from pocketllm.runner.cuda_graphs import HostBatch
from pocketllm.runner.pending_inputs import PendingInputs

STOP, STEP = 0, 1
HEADER = 6  # kind, tokens, sequences, block-table width, sampling rows, 1 if state slots follow


@dataclass(frozen=True)
class StepInputs:
    """What one forward pass needs: the flat batch, its metadata and the rows whose logits are wanted."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: list[int]


class StepChannel:
    """Broadcasts from rank 0 over the (gloo, host-memory) step group; every other rank receives in the same
    order and moves the tensors to its ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _broadcast(self, tensor: torch.Tensor) -> None:
        with lost_rank_is_fatal():
            dist.broadcast(tensor, src=0, group=step_group())

    def send(self, step: StepInputs) -> None:
        """Rank 0: publish this step's inputs."""
        meta = step.meta
        state = meta.state_slots_host
        lists = [*meta.query_start, *meta.context_lens, *step.sample_index, *(state or [])]
        header = [STEP, step.input_ids.numel(), meta.num_seqs, meta.block_tables.shape[1], len(step.sample_index),
                  int(state is not None)]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        tensors = [step.input_ids, step.positions, meta.slot_mapping, meta.block_tables.flatten()]
        payload = torch.cat([t.to("cpu", torch.int64) for t in tensors] + [torch.tensor(lists, dtype=torch.int64)])
        self._broadcast(payload)

    def send_host(self, host: HostBatch) -> None:
        """Rank 0 on the CUDA kernel path: publish the step's host-side batch (the same wire layout)."""
        n, width = host.num_seqs, max(len(t) for t in host.tables)
        header = [STEP, host.num_tokens, n, width, len(host.sample_index), 1]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        tables = [v for t in host.tables for v in (*t, *[0] * (width - len(t)))]
        payload = [*host.input_ids, *host.positions, *host.slots, *tables, *host.query_start, *host.context_lens,
                   *host.sample_index, *host.state_slots]
        self._broadcast(torch.tensor(payload, dtype=torch.int64))

    def receive_host(self) -> HostBatch | None:
        """Workers on the CUDA kernel path: the next step's host-side batch, or None when rank 0 says stop."""
        header = torch.empty(HEADER, dtype=torch.int64)
        self._broadcast(header)
        kind, tokens, seqs, width, samples, _ = header.tolist()
        if kind == STOP:
            return None
        payload = torch.empty(3 * tokens + seqs * width + (seqs + 1) + seqs + samples + seqs, dtype=torch.int64)
        self._broadcast(payload)
        values = payload.tolist()
        parts, at = [], 0
        for size in (tokens, tokens, tokens, seqs * width, seqs + 1, seqs, samples, seqs):
            parts.append(values[at:at + size])
            at += size
        ids, positions, slots, flat_tables, query_start, context_lens, sample_index, state = parts
        tables = [flat_tables[i * width:(i + 1) * width] for i in range(seqs)]
        return HostBatch(ids, positions, slots, query_start, context_lens, sample_index, tables, PendingInputs(),
                         state)

    def send_stop(self) -> None:
        """Rank 0: tell the workers to leave their loop."""
        self._broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64))

    def receive(self, block_size: int) -> StepInputs | None:
        """Workers: the next step's inputs, or None when rank 0 says stop."""
        header = torch.empty(HEADER, dtype=torch.int64)
        self._broadcast(header)
        kind, tokens, seqs, width, samples, has_state = header.tolist()
        if kind == STOP:
            return None
        size = 3 * tokens + seqs * width + (seqs + 1) + seqs + samples + (seqs if has_state else 0)
        payload = torch.empty(size, dtype=torch.int64)
        self._broadcast(payload)
        on_device = payload[:3 * tokens + seqs * width].to(self.device)
        ids, positions, slots, tables = on_device.split([tokens, tokens, tokens, seqs * width])
        host = payload[3 * tokens + seqs * width:].tolist()
        query_start, host = host[:seqs + 1], host[seqs + 1:]
        context_lens, host = host[:seqs], host[seqs:]
        sample_index, state = host[:samples], host[samples:]
        extra = {}
        if has_state:
            extra = {"state_slots": torch.tensor(state, dtype=torch.int64, device=self.device),
                     "state_slots_host": state}
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(seqs, width), query_start=query_start,
                                 context_lens=context_lens, block_size=block_size, **extra)
        return StepInputs(ids, positions, meta, sample_index)
