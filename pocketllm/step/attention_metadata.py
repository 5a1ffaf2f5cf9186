"""What one forward pass needs to know about the batch's sequences and the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """A flat batch of sequence chunks.

    Sequence ``i`` contributes query tokens ``query_start[i]:query_start[i+1]`` of the flat batch; its
    context (cached prefix plus these tokens) is ``context_lens[i]`` tokens long, held in the KV blocks
    listed in row ``i`` of ``block_tables``. ``slot_mapping`` gives each new token's cache slot
    (block * block_size + offset).
    """

    slot_mapping: torch.Tensor          # [num_tokens] int64 (int32 on the kernel path; -1: store nothing)
    block_tables: torch.Tensor          # [num_seqs, max_blocks] int64 (int32 on the kernel path; padded with 0)
    query_start: list[int]              # host copy, len num_seqs + 1
    context_lens: list[int]             # host copy, len num_seqs
    block_size: int
    # CUDA kernel path only (None on the PyTorch reference path): device copies of the lengths, int32, so
    # that the kernels (and CUDA-graph replays) need nothing from the host lists.
    context_lens_gpu: torch.Tensor | None = None    # [num_seqs] int32
    query_start_gpu: torch.Tensor | None = None     # [num_seqs + 1] int32
    max_query_len: int = 0
    num_splits: int = 1                             # decode rows: context splits per sequence
    decode_tile: int | None = None                  # decode rows: KV tile width (None: the kernel's default)
    # Steps mixing decode rows and prompt chunks: the leading sequences that have one query token each, which
    # the decode kernel attends (the prefill kernel takes the rest; 0 otherwise).
    num_decode_rows: int = 0
    split_counters: torch.Tensor | None = None      # decode, num_splits > 1: int32 ≥ num_seqs × KV heads, zero
    # Decode rows that are positions of one sequence (``HostBatch.flattened``): a row reads keys/values that other
    # rows of the step store, so every row's store lands before any row attends (no store inside attention).
    rows_share_context: bool = False
    # Hybrid (recurrent-state) models only; None otherwise: each sequence's slot in the state pool.
    state_slots: torch.Tensor | None = None         # [num_seqs] int64
    state_slots_host: list[int] | None = None       # host copy
    # Speculative decoding on a hybrid model: per sequence, the first slot of the checkpoints its verify chunk
    # writes (the state after each of its positions but the last), -1 for other sequences; None: no verify chunk.
    state_checkpoints_host: list[int] | None = None
    # Decode rows on the kernel path whose recurrent states run in chains (CUDA graphs of hybrid models): per row,
    # the slot it reads its states from when it starts a chain, -1 when it continues the row before it (one
    # sequence's positions, ``HostBatch.flattened``); ``state_slots`` then says where each row's states go.
    state_chain: torch.Tensor | None = None         # [num_seqs] int32
    # DeepSeek-V4 steps of short chunks laid out as a grid (``runner/reference_graphs.py``): each row one query, the
    # rows ``grid_len`` consecutive positions of each sequence in turn (row ``s * grid_len + j``). ``grid_real``:
    # the step's own rows (the others repeat their sequence's last one and change no state); ``grid_checkpoints``:
    # the state slot each row's states are copied to after it (its verify chunk's checkpoint, else scratch).
    grid_len: int = 1
    grid_real: torch.Tensor | None = None           # [num_seqs] bool
    grid_checkpoints: torch.Tensor | None = None    # [num_seqs] int64

    @property
    def uses_kernels(self) -> bool:
        return self.context_lens_gpu is not None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.query_start[-1] == self.num_seqs
