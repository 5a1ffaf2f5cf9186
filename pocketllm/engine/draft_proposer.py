"""A draft model (speculative ``method="draft_model"``): a smaller checkpoint with the target's tokenizer, run by
a model runner of its own, proposes each verify chunk's tokens one forward at a time.

The draft runner's KV cache has as many blocks as the target's, and the draft reads and writes them through the
target's block tables: block ``b`` of the draft cache holds the draft's keys and values of the tokens that block
``b`` of the target cache holds. So that this stays true, the draft runs every chunk the target runs, in the
same step (prefill chunks, decode rows of requests that do not speculate), and the prefix cache, preemption and
the release of rejected slots (``BlockManager.truncate``) serve both caches at once.

A step with verify chunks runs the draft ``k`` times before the target's forward: the first forward is the
step's chunks as the draft sees them (a verify chunk as its last known token), and each of the others one row per
speculating request (its latest proposal). A verify step that keeps every proposal leaves the draft one token
behind (it never ran the last proposal): ``Request.draft_lag``, caught up by the request's next draft forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pocketllm.engine.proposer import Proposer, chains_on_device, greedy_chain
from pocketllm.engine.request import Request
from pocketllm.runner.model_runner import ModelRunner
from pocketllm.runner.sampler import SamplingRow, argmax_rows
from pocketllm.runner.spec_verify import draw_proposals
from pocketllm.step.scheduled_chunk import ScheduledChunk


@dataclass(frozen=True)
class DraftModel:
    """The draft checkpoint as the backend hands it to the engine: its config, its weights (None: random ones,
    ``load_format="dummy"``) and its matrices' storage type (``Checkpoint.weight_type``)."""

    hf_config: Any
    weights: Iterable[tuple[str, torch.Tensor]] | None
    weight_type: str | None = None


class DraftSequence:
    """A request as the draft runner reads it: the request's prompt and block table, its output tokens up to the
    draft's first input of the step, then the proposals made so far. One per request for as long as the request
    runs every step, so that the CPU decode step's dense rows (kept per sequence object) stay current."""

    __slots__ = ("request", "output_token_ids", "chain_row")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.output_token_ids: list[int] = []
        # While greedy proposals chain on the device: the row of the previous draft forward's tokens that holds
        # this sequence's latest proposal (its next input, not yet on the host); -1 otherwise.
        self.chain_row = -1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def block_table(self) -> list[int]:
        return self.request.block_table

    @property
    def pending_row(self) -> int:
        return self.chain_row if self.chain_row >= 0 else self.request.pending_row

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def state_slot(self) -> int:
        return self.request.state_slot

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)


class DraftProposer(Proposer):
    """Proposes up to ``k`` tokens per verify chunk with the draft model's ``runner``. The scheduler reserves a
    verify chunk's slots through ``propose`` (placeholder tokens); ``fill`` then runs the draft and puts the
    proposals in."""

    PLACEHOLDER = 0

    def __init__(self, runner: ModelRunner, k: int, chain_on_device: bool | None = None) -> None:
        """``chain_on_device`` (default: on CUDA): a step whose verifying requests are all greedy (without
        penalties) feeds each draft forward the previous one's argmax on the device, and reads the proposals
        back once, after the last draft forward, instead of once per forward."""
        self.runner = runner
        self.k = k
        self.chain_on_device = runner.device.type == "cuda" if chain_on_device is None else chain_on_device
        self._sequences: dict[str, DraftSequence] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Placeholders for ``min(k, limit)`` proposals: the scheduler allocates their slots and budget, and
        ``fill`` replaces them (a draft model proposes as many tokens as it is asked for)."""
        return [self.PLACEHOLDER] * max(0, min(self.k, limit))

    def _sequence(self, request: Request, kept: dict[str, DraftSequence]) -> DraftSequence:
        sequence = self._sequences.get(request.request_id)
        if sequence is None or sequence.request is not request:
            sequence = DraftSequence(request)
        kept[request.request_id] = sequence
        return sequence

    @torch.inference_mode()
    def fill(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Run the draft over the step's ``chunks`` and return them with every verify chunk's placeholders
        replaced by the draft's proposals (and, for a sampling request, the distributions they came from)."""
        kept: dict[str, DraftSequence] = {}
        mirrored: list[ScheduledChunk] = []
        verifying: list[tuple[int, DraftSequence]] = []    # (index in ``chunks``, its sequence)
        rows: list[int] = []                                 # each verify chunk's logits row of the first forward
        caught_up: list[tuple[DraftSequence, int]] = []      # last tokens held back while the first forward runs
        row = 0
        for index, chunk in enumerate(chunks):
            request = chunk.request
            sequence = self._sequence(request, kept)
            sequence.output_token_ids[:] = request.output_token_ids
            lag = request.draft_lag
            request.draft_lag = 0
            end = chunk.end - len(chunk.draft)
            if chunk.num_tokens - len(chunk.draft) == 1 and lag:
                # One known token to run, and the one before it the draft never ran: both, shaped as a verify
                # chunk (the CPU decode step runs that as rows of one call; the other paths as a 2-token chunk).
                last = sequence.output_token_ids.pop()
                mirror = ScheduledChunk(sequence, 2, end - 2, True, (last,))
                caught_up.append((sequence, last))
                row += 2
            else:
                start = chunk.start - lag
                samples = chunk.samples or bool(chunk.draft)
                mirror = ScheduledChunk(sequence, end - start, start, samples)
                row += int(samples)
            mirrored.append(mirror)
            if chunk.draft:
                verifying.append((index, sequence))
                rows.append(row - 1)
        self._sequences = kept
        logits = self.runner.launch(mirrored)
        for sequence, last in caught_up:
            sequence.output_token_ids.append(last)
        if not verifying:
            return chunks   # the draft only wrote its cache
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        return self._propose_all(chunks, logits, verifying)

    def _propose_all(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                     verifying: list[tuple[int, DraftSequence]]) -> list[ScheduledChunk]:
        """From the first forward's ``logits`` of the verifying requests, their proposals: then one forward of a
        row per request that still has proposals to make, until each has its chunk's number; the chunks
        filled."""
        wanted = [len(chunks[index].draft) for index, _ in verifying]
        proposals: list[list[int]] = [[] for _ in verifying]
        probs: list[list[torch.Tensor]] = [[] for _ in verifying]
        active = list(range(len(verifying)))
        if self.chain_on_device and chains_on_device([s.request for _, s in verifying]):
            proposals = self._greedy_chain(logits, [s for _, s in verifying], wanted)
            active = []
        while active:
            requests = [verifying[i][1] for i in active]
            sampling_rows = [SamplingRow(s.request.params, s.prompt_token_ids, s.output_token_ids, s.request.generator)
                             for s in requests]
            tokens, dists = draw_proposals(self.runner.sampler, logits, sampling_rows)
            for i, token, dist in zip(active, tokens, dists):
                proposals[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            active = [i for i in active if len(proposals[i]) < wanted[i]]
            if not active:
                break
            step = []
            for i in active:
                sequence = verifying[i][1]
                sequence.output_token_ids.append(proposals[i][-1])
                step.append(ScheduledChunk(sequence, 1, sequence.num_tokens - 1, True))
            logits = self.runner.launch(step)
        filled = list(chunks)
        for (index, _), tokens_i, probs_i in zip(verifying, proposals, probs):
            draft_probs = torch.stack(probs_i) if probs_i else None
            filled[index] = chunks[index]._replace(draft=tuple(tokens_i), draft_probs=draft_probs)
        return filled

    def _greedy_chain(self, logits: torch.Tensor, sequences: list[DraftSequence], wanted: list[int]
                      ) -> list[list[int]]:
        """Greedy proposals of ``sequences`` (``wanted[i]`` each) from the first forward's ``logits``: each further
        draft forward takes its inputs from the previous one's argmax, still on the device (a pending input), so
        the host launches the next forward while the last runs (``greedy_chain``)."""
        rows = [SamplingRow(s.request.params, s.prompt_token_ids, s.output_token_ids, s.request.generator)
                for s in sequences]
        sampler = self.runner.sampler

        def forward(tokens: torch.Tensor, active: list[tuple[int, int]], depth: int) -> torch.Tensor:
            step = []
            for row, i in active:
                sequence = sequences[i]
                sequence.chain_row = row
                # The proposal made ``depth`` forwards ago runs at the position after the known tokens and the
                # proposals before it; none is on the host, so the chunk's one input is pending.
                step.append(ScheduledChunk(sequence, 1, sequence.num_tokens + depth - 1, True))
            logits = self.runner.launch(step, tokens)
            return argmax_rows(sampler.processed_scores(logits, [rows[i] for _, i in active]))

        try:
            return greedy_chain(argmax_rows(sampler.processed_scores(logits, rows)), wanted, forward)
        finally:
            for sequence in sequences:
                sequence.chain_row = -1
