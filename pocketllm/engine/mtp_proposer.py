"""The checkpoint's own MTP head (speculative ``method="mtp"``: Qwen3.5, DeepSeek-V4): proposes verify tokens.

At position ``p`` the head reads the target's hidden state at ``p`` and the token at ``p + 1``, and predicts the
token at ``p + 2``. Its keys and values are one more layer of the target's KV cache (``runner/mtp_head.py``), so
the head must run every position the target keeps, once its next token is known:

- ``advance``, right after each target step (whose tokens the engine reads back at once with speculation):
  the head runs the positions the step kept, each with the token after it (the prompt's next token, the sampled
  token, or a verify chunk's accepted proposals and its last emitted token), over the target's hidden states of
  the step. The head's hidden state at the request's last kept position is kept for the next step.
- ``fill``, before the next target step: a verify chunk starting at ``s`` draws its first proposal from the
  kept hidden state (position ``s - 1``); each further proposal runs the head one more position (``s``,
  ``s + 1``, ...) on its own last hidden state and proposal. Those keys and values go to the verify chunk's own
  slots; the next ``advance`` overwrites the accepted ones with the target's hidden states, and the rejected ones
  are released with the target's.

Preemption needs nothing: the request's recomputed prompt runs through ``advance`` again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pocketllm.engine.proposer import Proposer, chains_on_device, greedy_chain
from pocketllm.engine.request import Request
from pocketllm.runner.model_runner import ModelRunner
from pocketllm.runner.sampler import SamplingRow, argmax_rows
from pocketllm.runner.spec_verify import draw_proposals
from pocketllm.step.host_batch import HostBatch, token_slice
from pocketllm.step.host_to_device import device_tensor
from pocketllm.step.pending_inputs import PendingInputs
from pocketllm.step.sampled import SampledToken
from pocketllm.step.scheduled_chunk import ScheduledChunk


@dataclass(frozen=True)
class HeadState:
    """The head's hidden state (as ``MtpHead.forward`` returns it) at a request's last kept ``position``."""

    request: Request
    position: int
    hidden: torch.Tensor


@dataclass(frozen=True)
class HeadRows:
    """One request's consecutive rows of a head forward: ``positions`` from ``start``, each with the token after
    it (``next_tokens``)."""

    request: Request
    start: int
    next_tokens: list[int]


def head_batch(rows: list[HeadRows], block_size: int) -> HostBatch:
    """The host batch of a head forward: each request's rows attend to the head's cache up to their last
    position, through the request's block table."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    for entry in rows:
        table = entry.request.block_table
        span = range(entry.start, entry.start + len(entry.next_tokens))
        ids.extend(entry.next_tokens)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        query_start.append(len(ids))
        context_lens.append(span.stop)
        tables.append(table)
    return HostBatch(ids, positions, slots, query_start, context_lens, [], tables, PendingInputs(),
                     [-1] * len(rows))


class MtpProposer(Proposer):
    """Proposes up to ``k`` tokens per verify chunk with the target runner's MTP head. The scheduler reserves a
    verify chunk's slots through ``propose`` (placeholder tokens); ``fill`` puts the proposals in."""

    PLACEHOLDER = 0
    reads_emitted_tokens = True

    def __init__(self, runner: ModelRunner, k: int, chain_on_device: bool | None = None) -> None:
        """``chain_on_device`` (default: on CUDA): chained proposals of greedy requests (without penalties) feed
        each head forward the previous one's argmax on the device and are read back once, after the last."""
        if runner.mtp_head is None:
            raise ValueError("the MTP proposer needs a model runner built with its MTP head")
        self.runner = runner
        self.head = runner.mtp_head
        self.k = k
        self.chain_on_device = runner.device.type == "cuda" if chain_on_device is None else chain_on_device
        self._states: dict[str, HeadState] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Placeholders for ``min(k, limit)`` proposals (``fill`` replaces them)."""
        return [self.PLACEHOLDER] * max(0, min(self.k, limit))

    @torch.inference_mode()
    def advance(self, chunks: list[ScheduledChunk], emitted: list[list[SampledToken]]) -> None:
        """After the target ran ``chunks`` (and they emitted ``emitted``, one list per sampling chunk): run the
        head over every position the step kept, and keep each request's last hidden state."""
        target = self.head.target_hidden()
        self.head.release_target_hidden()
        tokens_of = iter(emitted)
        rows: list[HeadRows] = []
        index: list[int] = []      # the target's rows the head reads, in ``rows`` order
        offset = 0
        for chunk in chunks:
            request, start = chunk.request, chunk.start
            tokens = [t.token_id for t in next(tokens_of)] if chunk.samples else []
            if chunk.draft:
                next_tokens = tokens     # the accepted proposals, then the target's own token
            elif chunk.samples:
                next_tokens = token_slice(request, start + 1, chunk.end) + tokens[:1] if tokens else []
            else:
                next_tokens = token_slice(request, start + 1, chunk.end + 1)
            if next_tokens:
                rows.append(HeadRows(request, start, next_tokens))
                index.extend(range(offset, offset + len(next_tokens)))
            offset += chunk.num_tokens
        self._states = {key: state for key, state in self._states.items() if not state.request.is_finished}
        if not rows:
            return
        hidden = target.index_select(0, torch.tensor(index, device=target.device))
        out = self.head.forward(head_batch(rows, self.runner.block_size), hidden)
        ends, end = [], 0
        for entry in rows:
            end += len(entry.next_tokens)
            ends.append(end - 1)
        last = out.index_select(0, torch.tensor(ends, device=out.device))
        for entry, row in zip(rows, last):
            request = entry.request
            self._states[request.request_id] = HeadState(request, entry.start + len(entry.next_tokens) - 1, row)

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """``chunks`` with every verify chunk's placeholders replaced by the head's proposals (and, for a sampling
        request, the distributions they came from). A verify chunk whose request has no head state at its last
        kept position (cannot happen while ``advance`` follows every step) decodes one token instead."""
        filled = list(chunks)
        verifying: list[int] = []
        for index, chunk in enumerate(chunks):
            if not chunk.draft:
                continue
            state = self._states.get(chunk.request.request_id)
            if state is None or state.request is not chunk.request or state.position != chunk.start - 1:
                filled[index] = chunk._replace(num_tokens=1, draft=())
                continue
            verifying.append(index)
        if not verifying:
            return filled
        wanted = [len(chunks[i].draft) for i in verifying]
        proposals: list[list[int]] = [[] for _ in verifying]
        probs: list[list[torch.Tensor]] = [[] for _ in verifying]
        active = list(range(len(verifying)))
        hidden = torch.stack([self._states[chunks[i].request.request_id].hidden for i in verifying])
        if self.chain_on_device and chains_on_device([chunks[i].request for i in verifying]):
            proposals = self._greedy_chain(hidden, [chunks[i] for i in verifying], wanted)
            active = []
        while active:
            requests = [chunks[verifying[i]].request for i in active]
            sampling_rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids + proposals[i],
                                         r.generator) for r, i in zip(requests, active)]
            tokens, dists = draw_proposals(self.runner.sampler, self.head.logits(hidden), sampling_rows)
            for i, token, dist in zip(active, tokens, dists):
                proposals[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            going = [j for j, i in enumerate(active) if len(proposals[i]) < wanted[i]]
            if not going:
                break
            active = [active[j] for j in going]
            hidden = hidden.index_select(0, torch.tensor(going, device=hidden.device))
            # One more position each: the last proposal after the position before it, on the head's own state.
            rows = [HeadRows(chunks[verifying[i]].request, chunks[verifying[i]].start + len(proposals[i]) - 1,
                             [proposals[i][-1]]) for i in active]
            hidden = self.head.forward(head_batch(rows, self.runner.block_size), hidden)
        for i, index in enumerate(verifying):
            draft_probs = torch.stack(probs[i]) if probs[i] else None
            filled[index] = chunks[index]._replace(draft=tuple(proposals[i]), draft_probs=draft_probs)
        return filled

    def _greedy_chain(self, hidden: torch.Tensor, verifying: list[ScheduledChunk], wanted: list[int]
                      ) -> list[list[int]]:
        """Greedy proposals of the ``verifying`` chunks (``wanted[i]`` each) from the head states ``hidden``: each
        further head forward takes the previous one's argmax as its input, still on the device (``greedy_chain``)."""
        rows = [SamplingRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids,
                            c.request.generator) for c in verifying]
        sampler = self.runner.sampler
        state = [hidden]

        def forward(tokens: torch.Tensor, active: list[tuple[int, int]], depth: int) -> torch.Tensor:
            keep = device_tensor([row for row, _ in active], torch.int64, hidden.device)
            # One more position each: the latest proposal after the position before it, on the head's own state.
            batch = head_batch([HeadRows(verifying[i].request, verifying[i].start + depth - 1, [self.PLACEHOLDER])
                                for _, i in active], self.runner.block_size)
            for j, (row, _) in enumerate(active):
                batch.pending.add(j, row)
            state[0] = self.head.forward(batch, state[0].index_select(0, keep), tokens)
            return argmax_rows(sampler.processed_scores(self.head.logits(state[0]), [rows[i] for _, i in active]))

        return greedy_chain(argmax_rows(sampler.processed_scores(self.head.logits(hidden), rows)), wanted, forward)
