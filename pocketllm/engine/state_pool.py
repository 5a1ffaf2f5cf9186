"""Slots of per-request recurrent state for hybrid models (Qwen3.5's Gated DeltaNet layers).

A linear-attention layer's state (conv inputs and the delta-rule matrix) has a fixed size per sequence, so
it lives in a pool of slots beside the paged KV cache; the runner binds the tensors, this class hands out
the indices. A request holds a slot from admission until it finishes, is cancelled or is preempted. The
model starts a sequence from zeros whenever its chunk begins at position 0, so a reused slot, or a
request recomputed after preemption, never sees stale state; chunked prefill carries the state across
chunks in the slot.
"""

from __future__ import annotations

from pocketllm.engine.request import Request


class StatePool:
    """Free-list allocator of ``num_slots`` state slots (one per request that may run at once). With
    ``checkpoints`` (speculative decoding: the most proposals a verify chunk holds), slot ``s`` also owns the
    ``checkpoints`` slots from ``num_slots + 1 + s * checkpoints`` on (after the runner's scratch slot), which a
    verify chunk fills with the state after each of its positions but the last."""

    def __init__(self, num_slots: int, checkpoints: int = 0) -> None:
        self.num_slots = num_slots
        self.checkpoints = checkpoints
        self.free = list(range(num_slots - 1, -1, -1))

    @property
    def num_bound_slots(self) -> int:
        """Every slot the runner binds tensors for: the request slots, the scratch slot and the checkpoints."""
        return self.num_slots + 1 + self.num_slots * self.checkpoints

    @property
    def num_free_slots(self) -> int:
        return len(self.free)

    def assign(self, request: Request) -> None:
        """Give ``request`` a slot (kept if it already holds one)."""
        if request.state_slot >= 0:
            return
        if not self.free:
            raise RuntimeError(f"no free recurrent-state slot for {request.request_id} ({self.num_slots} slots)")
        request.state_slot = self.free.pop()
        if self.checkpoints:
            request.state_checkpoints = self.num_slots + 1 + request.state_slot * self.checkpoints

    def release(self, request: Request) -> None:
        """Return ``request``'s slot, if it holds one."""
        if request.state_slot >= 0:
            self.free.append(request.state_slot)
            request.state_slot = request.state_checkpoints = -1
