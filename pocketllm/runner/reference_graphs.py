"""Decode CUDA graphs of the reference step, for a model whose attention is its own (DeepSeek-V4) and so runs
the PyTorch reference forward on CUDA rather than the Triton kernel metadata of ``cuda_graphs.py``.

A step of short chunks in which every token samples (plain decode rows; speculative verify chunks, each with its
state checkpoints) runs as a grid: ``L`` rows for each sequence (``L``: the step's longest chunk), row
``s * L + j`` the ``j``-th position of sequence ``s``, each row a query of its own. The grid's sequences are padded
to a batch bucket (``graph_buckets``) with copies of sequence 0, and a sequence's rows past its chunk repeat its
last row. Such a row computes what the row it repeats computes and writes the same keys to the same slots, while
the model's state updates skip it (``AttentionMetadata.grid_real``), so it changes nothing; a verify chunk's
states after each position go to its checkpoint slots (``grid_checkpoints``; scratch for the other rows).

A grid of up to ``max_num_seqs`` rows with contexts of up to ``MAX_CONTEXT_BUCKET`` tokens replays the graph of
its (batch bucket, ``L``, context bucket): the context bucket is the power of two, from ``MIN_CONTEXT_BUCKET``,
that holds the step's longest context, since the compressed histories are padded to the entries of that context.
A graph is captured the first time its buckets are needed, right after the step that needed them ran eagerly on
the same static inputs (that step's result stands; the capture only records), so short runs capture few graphs.
Every row pools its open window on every step (``WindowPool.pool_rows``), which costs the device little beside
the step. The rows' inputs are int32 in one static buffer, filled by one host copy, and widened to int64 inside
the graph.

In a step that also holds prompt chunks, the decode rows and verify chunks run as a grid and the prompt chunks
eagerly beside it (an MTP head gets the two parts' hidden states joined in chunk order). Steps of any other
shape (more rows than ``max_num_seqs``, longer contexts) run the reference step eagerly, as do those of buckets
whose capture failed.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pocketllm.runner.cuda_graphs import PinnedRing, graph_buckets
from pocketllm.runner.step_backend import HostBatchStep, ReferenceStep, in_chunk_order
from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.host_batch import HostBatch, gather_host_batch
from pocketllm.step.host_to_device import device_tensor
from pocketllm.step.pending_inputs import PendingInputs
from pocketllm.step.scheduled_chunk import ScheduledChunk

logger = logging.getLogger("pocketllm.runner")

# The smallest context bucket: shorter contexts share one graph per batch bucket.
MIN_CONTEXT_BUCKET = 256
# Steps with a longer context run eagerly: their padded histories would hold a graph's memory (kept for the
# engine's life) of up to twice their entries, and their device time, not the launches, dominates them.
MAX_CONTEXT_BUCKET = 8192
# Segments of the static input buffer (each ``max_num_seqs`` rows, aligned): token ids, the row each row takes its
# token from (itself, or the row it repeats), positions, KV slots, state slots, whether the row is real, its
# checkpoint slot; then the block tables.
_SEGMENTS = 7
# A step whose chunks are longer runs eagerly.
MAX_GRID_LEN = 16


def context_bucket(longest: int, max_model_len: int) -> int:
    """The context a graph of a step whose longest context is ``longest`` is captured for."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < longest:
        bucket *= 2
    return max(longest, min(bucket, max_model_len))


class ReferenceGraphStep(HostBatchStep):
    """The reference step with its grid steps replayed from CUDA graphs (``replay=False``: the padded static-input
    forward runs eagerly every step instead, which is how the tests check the grids on CPU)."""

    def __init__(self, reference: ReferenceStep, replay: bool = True) -> None:
        super().__init__(reference.block_size, reference.step_channel)
        self.reference = reference
        self.model = reference.model
        self.device = reference.device
        self.replay = replay
        self.buckets: list[int] = []     # empty until ``setup``: every step runs eagerly
        # The state pool's scratch slot (``ModelRunner.allocate_state_pool``); None: verify chunks run eagerly.
        self.scratch_slot: int | None = None
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # With an MTP head: the rows' hidden states (``mtp_target_hidden``) of every grid step, static.
        self.hidden: torch.Tensor | None = None
        self.failed: set[tuple[int, int, int]] = set()   # buckets whose capture failed: their steps run eagerly
        self.grid_steps = 0      # steps (or their decode rows and verify chunks) run over the static inputs
        self.split_steps = 0     # of which beside prompt chunks run eagerly
        self.verify_steps = 0    # of which with verify chunks
        self.replays = 0         # of which replayed from a graph
        self.verify_replays = 0  # of which both
        self.ring = PinnedRing() if self.device.type == "cuda" else None

    def setup(self, max_num_seqs: int, max_model_len: int) -> None:
        """The static inputs and logits for grids of up to ``max_num_seqs`` rows of up to ``max_model_len``
        tokens; graphs are captured as steps need them."""
        self.max_model_len = max_model_len
        self.width = -(-min(max_model_len, MAX_CONTEXT_BUCKET) // self.block_size)   # (longer steps run eagerly)
        self.segment = -(-max_num_seqs // 16) * 16
        self.static = torch.zeros(_SEGMENTS * self.segment + max_num_seqs * self.width, dtype=torch.int32,
                                  device=self.device)
        self.logits = torch.empty(max_num_seqs, self.model.lm_head.vocab_size, dtype=self.model.lm_head.logits_dtype,
                                  device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.replay else None
        self.buckets = graph_buckets(max_num_seqs)

    def launch(self, chunks: list[ScheduledChunk], previous_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The step's decode rows and verify chunks as a grid, where they fit one, and any other chunks eagerly
        beside it, the logits (and, for an MTP head, every row's hidden states) in the chunk order; else the
        whole step eagerly."""
        mine: list[ScheduledChunk] = []
        others: list[ScheduledChunk] = []
        for chunk in chunks:
            (mine if self._fits(chunk) else others).append(chunk)
        host = gather_host_batch(mine, self.block_size) if self.buckets and mine else None
        key = None if host is None else self._grid_key(host)
        if key is None or key in self.failed:
            return self.reference.launch(chunks, previous_tokens)
        fast = self._grid(host, previous_tokens, key)
        if not others:
            return fast
        self.split_steps += 1
        fast_hidden = getattr(self.model, "mtp_target_hidden", None)
        rest = self.reference.launch(others, previous_tokens)
        if fast_hidden is not None:
            self.model.mtp_target_hidden = in_chunk_order(chunks, mine, fast_hidden, self.model.mtp_target_hidden,
                                                          lambda chunk: chunk.num_tokens)
        return in_chunk_order(chunks, mine, fast, rest)

    @staticmethod
    def _fits(chunk: ScheduledChunk) -> bool:
        """Whether a chunk can be part of a grid: a decode row, or a verify chunk with state checkpoints (every
        token of either samples)."""
        if chunk.draft:
            return chunk.num_tokens <= MAX_GRID_LEN and getattr(chunk.request, "state_checkpoints", -1) >= 0
        return chunk.num_tokens == 1 and chunk.samples

    def run(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.reference.run(host, previous_tokens)

    def _grid_key(self, host: HostBatch) -> tuple[int, int, int] | None:
        """(batch bucket, rows a sequence, context bucket) of the grid the host batch of chunks that fit one runs
        as; None: it runs eagerly."""
        length = host.max_query_len
        longest = max(host.context_lens)
        if ((length > 1 and self.scratch_slot is None) or host.num_seqs * length > self.buckets[-1]
                or longest > MAX_CONTEXT_BUCKET or max(len(t) for t in host.tables) > self.width):
            return None
        bucket = next(b for b in self.buckets if b >= host.num_seqs * length)
        return bucket // length, length, context_bucket(longest, self.max_model_len)

    def _grid(self, host: HostBatch, previous_tokens: torch.Tensor | None, key: tuple[int, int, int]
              ) -> torch.Tensor:
        """A grid step through the graph of its buckets ``key`` (captured now if it is the first such step);
        the logits of the host batch's rows, in its order."""
        seqs, length, _ = key
        self.grid_steps += 1
        self.verify_steps += length > 1
        rows = self._send(host, seqs, length)
        pending = PendingInputs()
        for position, row in zip(host.pending.positions, host.pending.rows):
            pending.add(rows[position], row)
        pending.fill(self.static[:seqs * length], previous_tokens)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            self.verify_replays += length > 1
        else:
            self._forward(*key)
            if self.replay:
                self._capture(*key)
        kept = None if self.hidden is None else self.hidden[:seqs * length]
        if rows == list(range(len(rows))):
            logits = self.logits[:len(rows)]
        else:   # (a new tensor: the static logits are the next step's)
            index = device_tensor(rows, torch.int64, self.device)
            logits = self.logits.index_select(0, index)
            kept = None if kept is None else kept.index_select(0, index)
        if kept is not None:   # the MTP head reads this step's rows
            self.model.mtp_target_hidden = kept[:len(rows)]
        return logits

    def _send(self, host: HostBatch, seqs: int, length: int) -> list[int]:
        """The host batch laid out as a grid of ``seqs`` sequences of ``length`` rows, into the static inputs;
        returns the grid row of each of its rows."""
        rows = seqs * length
        seg, width = self.segment, self.width
        size = _SEGMENTS * seg + rows * width
        if self.ring is not None:
            turn, buf = self.ring.take(size)
        else:
            turn, buf = None, np.zeros(size, dtype=np.int32)
        n, starts, checkpoints = host.num_seqs, host.query_start, host.state_checkpoints
        # Per grid row: the host row it takes its inputs from (itself, or the row it repeats), whether it is that
        # row, and where its states go after it. The sequences past the batch's repeat sequence 0.
        source, real, checkpoint = [], [], []
        scratch = -1 if self.scratch_slot is None else self.scratch_slot   # (read only by grids of several rows)
        for s in range(seqs):
            c = s if s < n else 0
            start, chunk = starts[c], starts[c + 1] - starts[c]
            for j in range(length):
                source.append(start + min(j, chunk - 1))
                real.append(int(j < chunk))
                keep = j < chunk - 1 and checkpoints[c] >= 0
                checkpoint.append(checkpoints[c] + j if keep else scratch)
        grid_row = [s * length + j for s in range(n) for j in range(starts[s + 1] - starts[s])]
        fetch = np.asarray(source)
        # Token ids: the real rows' (pending ones filled on the device afterwards); every row then takes the token
        # of the row it repeats, inside the graph.
        owner = [grid_row[t] for t in source]
        sequence_of = np.repeat(np.arange(n), np.diff(host.query_start))
        state = np.asarray(host.state_slots)[sequence_of[fetch]]
        for k, values in enumerate((np.asarray(host.input_ids)[fetch], owner, np.asarray(host.positions)[fetch],
                                    np.asarray(host.slots)[fetch], state, real, checkpoint)):
            buf[k * seg:k * seg + rows] = values
        tables = buf[_SEGMENTS * seg:size].reshape(rows, width)
        for row, t in enumerate(source):   # (zero past a table: its padded history reads entry 0 there)
            table = host.tables[sequence_of[t]]
            tables[row, :len(table)] = table
            tables[row, len(table):] = 0
        if self.ring is not None:
            self.ring.send(turn, size, self.static)
        else:
            self.static[:size].copy_(torch.from_numpy(buf))
        return grid_row

    def _forward(self, seqs: int, length: int, context: int) -> None:
        """The model over the grid of the first ``seqs * length`` static rows, its histories padded for
        ``context`` tokens, into the static logits (what a graph records)."""
        seg, rows = self.segment, seqs * length
        ids, owner, positions, slots, state, real, checkpoints = (
            self.static[k * seg:k * seg + rows] for k in range(_SEGMENTS))
        tables = self.static[_SEGMENTS * seg:_SEGMENTS * seg + rows * self.width].view(rows, self.width).long()
        # The host lists give the padding of the compressed histories (every context as the bucket's) and the
        # grid's shape; the state slots' host copy is not read on a grid step.
        stateful = self.reference.has_state
        meta = AttentionMetadata(slot_mapping=slots.long(), block_tables=tables, query_start=list(range(rows + 1)),
                                 context_lens=[context] * rows, block_size=self.block_size,
                                 state_slots=state.long() if stateful else None,
                                 state_slots_host=[0] * rows if stateful else None, grid_len=length,
                                 grid_real=real.bool(), grid_checkpoints=checkpoints.long())
        hidden = self.model(ids.long().index_select(0, owner.long()), positions.long(), meta)
        self.logits[:rows].copy_(self.model.compute_logits(hidden))
        kept = getattr(self.model, "mtp_target_hidden", None)
        if kept is not None:
            if self.hidden is None:   # (a key's first step runs eagerly: never allocated inside a capture)
                self.hidden = torch.empty((self.logits.shape[0], *kept.shape[1:]), dtype=kept.dtype,
                                          device=self.device)
            self.hidden[:rows].copy_(kept)

    def _capture(self, seqs: int, length: int, context: int) -> None:
        """Record the graph of ``_forward(seqs, length, context)``; where that fails (out of memory, say), the
        buckets' steps run eagerly from then on."""
        key = seqs, length, context
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # (thread_local: a capture during serving does not fail on another thread's CUDA call)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward(*key)
        except RuntimeError as error:
            self.failed.add(key)
            logger.warning("the CUDA graph of %d sequences of %d rows, histories padded for %d tokens, could not "
                           "be captured (%s): those steps run eagerly", *key, str(error).splitlines()[0])
            return
        self.graphs[key] = graph
        logger.info("captured the CUDA graph of %d sequences of %d rows, histories padded for %d tokens, in %.2f s",
                    *key, time.perf_counter() - started)
