"""Inputs of a step that are still on the device: tokens the previous (unread) step sampled."""

from __future__ import annotations

import torch

from pocketllm.step.host_to_device import device_tensor


class PendingInputs:
    """Positions in a step's flat input ids that take a token from the previous step's sampled tokens."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.rows: list[int] = []

    def add(self, position: int, row: int) -> None:
        self.positions.append(position)
        self.rows.append(row)

    def __bool__(self) -> bool:
        return bool(self.positions)

    def fill(self, input_ids: torch.Tensor, previous_tokens: torch.Tensor | None) -> None:
        """``input_ids[position] = previous_tokens[row]`` on the device, without waiting for it."""
        if not self.positions:
            return
        if previous_tokens is None:
            raise RuntimeError("a step has pending inputs but the previous step's tokens were not given")
        n = len(self.rows)
        if self.positions == self.rows == list(range(n)) and n == previous_tokens.numel():
            # Steady decode: the same requests in the same order, one row each.
            input_ids[:n].copy_(previous_tokens)
            return
        device = input_ids.device
        rows = device_tensor(self.rows, torch.int64, device)
        positions = device_tensor(self.positions, torch.int64, device)
        input_ids.index_copy_(0, positions, previous_tokens.index_select(0, rows).to(input_ids.dtype))
