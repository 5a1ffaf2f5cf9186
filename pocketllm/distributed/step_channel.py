"""Rank 0 → workers: each step's batch as a fixed header plus one flat int64 payload (both in host memory), or
a stop message."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pocketllm.distributed import lost_rank_is_fatal
from pocketllm.distributed.group import step_group
from pocketllm.step.host_batch import HostBatch
from pocketllm.step.pending_inputs import PendingInputs

STOP, STEP = 0, 1
HEADER = 6  # kind, tokens, sequences, block-table width, sampling rows, 1 (state slots follow)


class StepChannel:
    """Broadcasts from rank 0 over the (gloo, host-memory) step group; every other rank receives in the same
    order and runs the same batch on its own device."""

    def _broadcast(self, tensor: torch.Tensor) -> None:
        with lost_rank_is_fatal():
            dist.broadcast(tensor, src=0, group=step_group())

    def send(self, host: HostBatch) -> None:
        """Rank 0: publish this step's host batch."""
        n, width = host.num_seqs, max(len(t) for t in host.tables)
        header = [STEP, host.num_tokens, n, width, len(host.sample_index), 1]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        tables = [v for t in host.tables for v in (*t, *[0] * (width - len(t)))]
        payload = [*host.input_ids, *host.positions, *host.slots, *tables, *host.query_start, *host.context_lens,
                   *host.sample_index, *host.state_slots]
        self._broadcast(torch.tensor(payload, dtype=torch.int64))

    def receive(self) -> HostBatch | None:
        """Workers: the next step's host batch, or None when rank 0 says stop."""
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
