"""A step's integer inputs on the host, gathered once from the scheduled chunks for every execution path
(the PyTorch reference forward, the CUDA kernel path, the tensor-parallel step broadcast)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pocketllm.step.pending_inputs import PendingInputs


@dataclass
class HostBatch:
    """A step's inputs on the host, as plain lists (block tables unpadded)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    context_lens: list[int]
    sample_index: list[int]
    tables: list[list[int]]
    pending: PendingInputs
    state_slots: list[int]      # hybrid models: each sequence's recurrent-state slot (-1 elsewhere)
    # hybrid models, verify chunks: the first slot of the sequence's state checkpoints (-1 elsewhere)
    state_checkpoints: list[int] = field(default_factory=list)
    # hybrid models, flattened steps: per row, the slot it reads its states from when it starts a chain of one
    # sequence's positions, -1 when it continues the row before it (``AttentionMetadata.state_chain``)
    state_chain: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def is_plain_decode(self) -> bool:
        """One token per sequence and every sequence samples: the shape decode graphs are captured for."""
        return self.num_tokens == self.num_seqs and len(self.sample_index) == self.num_seqs

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    def flattened(self) -> HostBatch:
        """The same tokens, each a sequence of its own: one query row attending its sequence's context up to and
        including its own position, through its sequence's block table. A step of short chunks (verify chunks,
        a draft's catch-up) then has the shape of a decode step. Rows of one sequence read keys and values that
        other rows of the same step store (``AttentionMetadata.rows_share_context``). Hybrid models: a
        sequence's rows form a state chain (``state_chain``) that starts from its state slot; each row's states
        go to the next of its verify chunk's checkpoint slots, the last row's to the sequence's slot."""
        contexts: list[int] = []
        tables: list[list[int]] = []
        state_slots: list[int] = []
        chain: list[int] = []
        hybrid = any(slot >= 0 for slot in self.state_slots)
        for i, (start, end) in enumerate(zip(self.query_start, self.query_start[1:])):
            length = end - start
            first = self.context_lens[i] - length + 1
            contexts.extend(range(first, self.context_lens[i] + 1))
            tables.extend([self.tables[i]] * length)
            if hybrid:
                slot = self.state_slots[i]
                checkpoints = self.state_checkpoints[i] if self.state_checkpoints else -1
                state_slots.extend(range(checkpoints, checkpoints + length - 1) if checkpoints >= 0
                                   else [slot] * (length - 1))
                state_slots.append(slot)
                chain.extend([slot] + [-1] * (length - 1))
        count = self.num_tokens
        if not hybrid:
            state_slots = [-1] * count
        return HostBatch(self.input_ids, self.positions, self.slots, list(range(count + 1)), contexts,
                         self.sample_index, tables, self.pending, state_slots, [-1] * count, chain)


def token_slice(request, start: int, end: int) -> list[int]:
    """The request's known tokens ``start:end`` (prompt, then output), without copying its whole history."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n:end - n]
    return prompt[start:] + request.output_token_ids[:end - n]


def gather_host_batch(chunks: Sequence, block_size: int) -> HostBatch:
    """The step's integer inputs, read off the scheduled chunks without copying whole token histories."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample_index: list[int] = []
    tables: list[list[int]] = []
    state_slots: list[int] = []
    checkpoints: list[int] = []
    pending = PendingInputs()
    total = 0
    for chunk in chunks:
        request = chunk.request
        start, count, end = chunk.start, chunk.num_tokens, chunk.end
        table = request.block_table
        if chunk.draft:
            # A verify chunk: the last token (known, or pending from the step in flight), then the proposals;
            # every position is scored.
            if chunk.last_token_pending:
                pending.add(len(ids), request.pending_row)
                ids.append(0)
            else:
                n_prompt = len(request.prompt_token_ids)
                ids.append(request.prompt_token_ids[start] if start < n_prompt
                           else request.output_token_ids[start - n_prompt])
            ids.extend(chunk.draft)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        elif chunk.last_token_pending:
            # Only a decode chunk can end with a pending token (a prefill chunk never follows a sampled one).
            pending.add(len(ids), request.pending_row)
            ids.append(0)
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        elif count == 1:
            n_prompt = len(request.prompt_token_ids)
            ids.append(request.prompt_token_ids[start] if start < n_prompt
                       else request.output_token_ids[start - n_prompt])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            ids.extend(token_slice(request, start, end))
            positions.extend(range(start, end))
            pos = np.arange(start, end)
            slots.extend((np.asarray(table, dtype=np.int64)[pos // block_size] * block_size
                          + pos % block_size).tolist())
        total += count
        query_start.append(total)
        context_lens.append(end)
        if chunk.draft:
            sample_index.extend(range(total - count, total))
        elif chunk.samples:
            sample_index.append(total - 1)
        tables.append(table)
        state_slots.append(request.state_slot)
        checkpoints.append(getattr(request, "state_checkpoints", -1) if chunk.draft else -1)
    return HostBatch(ids, positions, slots, query_start, context_lens, sample_index, tables, pending, state_slots,
                     checkpoints)
