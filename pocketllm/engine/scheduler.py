"""One token-budget scheduler: every step mixes decode tokens and prefill chunks under one budget."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from pocketllm.engine.block_manager import BlockManager
from pocketllm.engine.proposer import Proposer
from pocketllm.engine.request import FinishReason, Request, RequestStatus
from pocketllm.engine.state_pool import StatePool
from pocketllm.step.scheduled_chunk import ScheduledChunk

logger = logging.getLogger("pocketllm.scheduler")


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    """Running requests first (oldest first), then waiting ones while the budget and the KV pool allow.

    When a running request cannot get a block, the newest running request is preempted: its blocks are
    freed and it goes back to the front of the queue to be recomputed (its generated tokens are kept).
    ``prefill_chunk`` bounds one request's prefill per step (0: whole prompts in one step).

    ``schedule`` may run while the previous step is still on the device: a request's pending token (sampled,
    not yet read back) is scheduled as its next decode input, unless that token is certain to end the
    request (its length limit). A preempted request with a pending token waits for it before readmission.
    """

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, prefill_chunk: int,
                 state_pool: StatePool | None = None, proposer: Proposer | None = None) -> None:
        self.limits = limits
        self.blocks = block_manager
        self.state_pool = state_pool    # hybrid models: a recurrent-state slot per running request
        self.prefill_chunk = prefill_chunk
        self.proposer = proposer        # speculative decoding: decode rows become verify chunks where it proposes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def set_prefill_chunk(self, tokens: int) -> None:
        self.prefill_chunk = max(0, int(tokens))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_size(self, remaining: int, budget: int, alone: bool) -> int:
        """Tokens of a prefill of ``remaining`` tokens that fit this step (0 if it must wait).

        Without chunking a prompt runs whole; one longer than the budget runs alone in its step.
        """
        if remaining == 1:
            return min(1, budget)
        if self.prefill_chunk == 0:
            return remaining if remaining <= budget or alone else 0
        return min(remaining, budget, self.prefill_chunk)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.free_request(victim)
        if self.state_pool is not None:
            self.state_pool.release(victim)
        victim.num_computed_tokens = 0
        victim.draft_lag = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        logger.debug("preempted %s (recompute %d tokens)", victim.request_id, victim.num_tokens)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        block_size = self.blocks.block_size
        for request in list(self.running):
            if (request.status is not RequestStatus.RUNNING or request.request_id in scheduled
                    or self._ends_with_pending(request)):
                continue
            computed = request.num_computed_tokens
            remaining = request.num_scheduled_tokens - computed
            if remaining == 1 and budget > 1 and self.proposer is not None:
                chunk = self._verify_chunk(request, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    scheduled.add(request.request_id)
                    budget -= chunk.num_tokens
                    continue
            if remaining == 1 and budget > 0 and computed < len(request.block_table) * block_size:
                # The common decode row: one token into a block the request already holds.
                chunks.append(ScheduledChunk(request, 1, computed, True))
                scheduled.add(request.request_id)
                budget -= 1
                continue
            n = self._chunk_size(remaining, budget, not chunks)
            if n == 0:
                continue
            while not self.blocks.can_allocate(request, n):
                victims = [r for r in self.running if r.request_id not in scheduled and r is not request]
                victim = victims[-1] if victims else request
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self.blocks.allocate(request, n)
            chunks.append(ScheduledChunk.of(request, n))
            scheduled.add(request.request_id)
            budget -= n
        in_flight = self._blocks_in_flight() if self.waiting and self.blocks.enable_prefix_caching else set()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break   # preempted while its last step ran: its token arrives with that step's results
            cached = self.blocks.cached_prefix(request) if not request.block_table else []
            if in_flight and not request.block_table and self._next_block_in_flight(request, cached, in_flight):
                deferred.append(self.waiting.popleft())
                continue
            if not request.block_table:
                self.blocks.record_lookup(request, cached)
            computed = len(cached) * self.blocks.block_size
            n = self._chunk_size(request.num_tokens - computed, budget, not chunks)
            if n == 0 or not self.blocks.can_allocate(request, computed + n - request.num_computed_tokens,
                                                      cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = computed
            request.num_cached_tokens = max(request.num_cached_tokens, computed)
            self.blocks.allocate(request, n, cached)
            if self.state_pool is not None:
                self.state_pool.assign(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            chunks.append(ScheduledChunk.of(request, n))
            scheduled.add(request.request_id)
            budget -= n
            if self.waiting and self.blocks.enable_prefix_caching:
                in_flight.update(self._uncached_keys(request))
            logger.debug("admitted %s: %d prompt tokens, %d from prefix cache, chunk %d",
                         request.request_id, request.num_tokens, computed, n)
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def _verify_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        """A decode row as a verify chunk: the last token and the proposer's tokens, with their KV slots (None
        when nothing is proposed, the request is constrained by a grammar, or the slots are not free: then it
        decodes one token as usual, preempting if it must). With the step before still in flight, the last token
        is the one it samples (pending) and the proposals are the proposer's guesses after it."""
        pending = request.num_pending_tokens
        if request.grammar is not None or pending > 1:
            return None
        # Never propose past the budget: the step emits at most one token more than it accepts.
        room = budget - 1
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - pending - 1)
        room = min(room, self.limits.max_model_len - request.num_tokens - pending - 1)
        if request.speculative_window is not None:
            room = min(room, request.speculative_window)
        if room < 1:
            return None
        propose = self.proposer.propose_after_pending if pending else self.proposer.propose
        draft = propose(request, room)
        if not draft or not self.blocks.can_allocate(request, 1 + len(draft)):
            return None
        self.blocks.allocate(request, 1 + len(draft))
        return ScheduledChunk(request, 1 + len(draft), request.num_computed_tokens, True, tuple(draft))

    def _uncached_keys(self, request: Request) -> set:
        """Prefix-cache keys of the request's full blocks of known tokens that are not registered yet."""
        full = request.num_tokens // self.blocks.block_size
        if request.num_hashed_blocks >= full:
            return set()
        return {key for key, _ in self.blocks.chain_keys(request.all_token_ids, full, request.num_hashed_blocks,
                                                         request.last_block_hash)}

    def _blocks_in_flight(self) -> set:
        """Keys of the blocks running requests are still computing (their prompts' blocks not yet cached)."""
        keys: set = set()
        for request in self.running:
            keys.update(self._uncached_keys(request))
        return keys

    def _next_block_in_flight(self, request: Request, cached: list[int], in_flight: set) -> bool:
        """Whether the first block of the request's prompt that the cache lacks (after ``cached``) is one a running
        request is computing: then the request waits a step or more and takes it from the cache (``n`` choices of
        one prompt compute it once), instead of computing the same block alongside."""
        if len(cached) >= self.blocks.usable_blocks(request):
            return False
        parent = self.blocks.blocks[cached[-1]].hash if cached else 0
        key, _ = next(self.blocks.chain_keys(request.all_token_ids, len(cached) + 1, len(cached), parent))
        return key in in_flight

    def _ends_with_pending(self, request: Request) -> bool:
        """The pending token reaches the request's token or context limit, so nothing more runs for it."""
        pending = request.num_pending_tokens
        return bool(pending) and request.reaches_length_limit(self.limits.max_model_len, pending)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (running or waiting) and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free_request(request)
        if self.state_pool is not None:
            self.state_pool.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
