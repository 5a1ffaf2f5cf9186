"""Dense per-sequence copies of the KV cache for the CPU decode step's multi-row batches.

A decode batch of several sequences reads each sequence's context from the paged cache; their blocks are
interleaved (they grew side by side), so every layer had to gather them into one tensor per step. These rows
keep each layer's keys and values of the batch's sequences dense ([rows, length, kv heads, head dim]) from
step to step: a step writes its new token into the paged cache and into the rows, and the paged cache is
gathered only for a row whose sequence is new to it (the batch changed, or the sequence ran a step elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DenseDecodeRows:
    """Each layer's K/V rows for up to ``max_rows`` sequences, within ``max_bytes`` across all layers."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int, max_bytes: int) -> None:
        self.num_layers = num_layers
        self.kv_shape = (num_kv_heads, head_dim)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []   # [rows, tokens, kv heads, head dim] each
        self.flat: list[torch.Tensor] = []   # the same tensors as K, V, K, V, ... (``cpu_native.decode_layers``)
        # Row i holds the context of request ``held[i][0]`` (as of its preemption count ``held[i][1]``) for its
        # first ``held[i][2]`` positions.
        self.held: list[tuple[object, int, int]] = []

    @property
    def owners(self) -> list[object]:
        return [request for request, _, _ in self.held]

    @property
    def stored(self) -> list[int]:
        return [count for _, _, count in self.held]

    def fits(self, rows: int, tokens: int, dtype: torch.dtype) -> bool:
        """Whether ``rows`` sequences of ``tokens`` positions fit the rows' limits."""
        return self._fits(rows, tokens, dtype)

    def _fits(self, rows: int, tokens: int, dtype: torch.dtype) -> bool:
        per_token = self.kv_shape[0] * self.kv_shape[1] * dtype.itemsize * 2 * self.num_layers
        return rows <= self.max_rows and rows * tokens * per_token <= self.max_bytes

    def _allocate(self, rows: int, tokens: int, dtype: torch.dtype) -> None:
        shape = (rows, tokens, *self.kv_shape)
        self.layers = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(self.num_layers)]
        self.flat = [t for pair in self.layers for t in pair]
        self.held = []

    def prepare(self, requests: Sequence[object], positions: Sequence[int], tables: Sequence[Sequence[int]],
                block_size: int, paged: Sequence[tuple[torch.Tensor, torch.Tensor]],
                adds: Sequence[int] | None = None) -> torch.Tensor | None:
        """Make row ``i`` hold every layer's K/V of ``requests[i]`` before ``positions[i]`` (gathering from the
        ``paged`` per-layer ``[slots, kv heads, head dim]`` views where a row is stale) and record that the
        step adds positions ``positions[i]`` on (``adds[i]`` of them, default 1: a verify step adds its proposals).
        Returns each row's flat index of its first added position in the rows (for ``index_copy_``), or None
        when the batch does not fit the rows' limits (the caller gathers).

        A row holding more positions than asked for is current: those past the request's position are ones a
        verify step wrote for proposals it rejected, which the request's later steps write again before any
        step attends to them."""
        rows = len(requests)
        # One position beyond the longest context stays spare: a compiled step (``cpu_compile``) that met rows
        # exactly as long as the attended context would take them as equal sizes and compile again when they
        # differ.
        adds = [1] * rows if adds is None else adds
        needed = max(pos + add for pos, add in zip(positions, adds)) + 1
        dtype = paged[0][0].dtype
        if not self._fits(rows, needed, dtype):
            return None
        have_rows, have_tokens = self.layers[0][0].shape[:2] if self.layers else (0, 0)
        if rows > have_rows or needed > have_tokens or self.layers[0][0].dtype != dtype:
            # Grow by doubling (each growth regathers every row), within the byte limit.
            new_rows = max(rows, have_rows) if self._fits(max(rows, have_rows), needed, dtype) else rows
            choices = (max(needed, 2 * have_tokens, 64), max(needed, 2 * have_tokens), needed)
            self._allocate(new_rows, next(t for t in choices if self._fits(new_rows, t, dtype)), dtype)
        width = self.layers[0][0].shape[1]
        source, target, held = [], [], []
        for i, (request, pos, table, add) in enumerate(zip(requests, positions, tables, adds)):
            preemptions = getattr(request, "num_preemptions", 0)
            current = (i < len(self.held) and self.held[i][0] is request and self.held[i][1] == preemptions
                       and self.held[i][2] >= pos)
            if not current:   # the row holds another sequence, or this one missed a step: regather it
                source.extend(table[p // block_size] * block_size + p % block_size for p in range(pos))
                target.extend(range(i * width, i * width + pos))
            held.append((request, preemptions, pos + add))
        if source:
            src, dst = torch.tensor(source), torch.tensor(target)
            for (k_rows, v_rows), (k_paged, v_paged) in zip(self.layers, paged):
                k_rows.view(-1, *self.kv_shape).index_copy_(0, dst, k_paged.index_select(0, src))
                v_rows.view(-1, *self.kv_shape).index_copy_(0, dst, v_paged.index_select(0, src))
        self.held = held + self.held[rows:]
        return torch.tensor([i * width + pos for i, pos in enumerate(positions)])
