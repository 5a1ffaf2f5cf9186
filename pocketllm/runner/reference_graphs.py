"""Decode CUDA graphs of the reference step, for a model whose attention is its own (DeepSeek-V4) and so runs
the PyTorch reference forward on CUDA rather than the Triton kernel metadata of ``cuda_graphs.py``.

A plain decode step (one token per sequence, every sequence sampling) of up to ``max_num_seqs`` sequences and
contexts of up to ``MAX_CONTEXT_BUCKET`` tokens replays a graph of the next batch bucket up (``graph_buckets``) and
of a context bucket: the power of two, from ``MIN_CONTEXT_BUCKET``, that holds the step's longest context, since
the compressed histories are padded to the entries of that context. A graph is captured the first time its pair
of buckets is needed, right after the step that needed it ran eagerly on the same static inputs (that step's
result stands; the capture only records), so short runs capture few graphs. Every row pools its open window on
every step (``WindowPool.pool_rows``), which costs the device little beside the step.

Padding rows repeat row 0 (its token, position, KV slot, state slot and block table): a padding row computes
what row 0 computes and writes the same values to the same places, so it changes nothing, where the kernel
path's padding rows (slot -1, context 0) rely on kernels that skip them. The rows' inputs are int32 in one static
buffer, filled by one host copy, and widened to int64 inside the graph.

Steps of any other shape (prompt chunks, verify chunks, more sequences than the largest bucket, longer contexts)
run the reference step eagerly, as do those of buckets whose capture failed.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pocketllm.runner.cuda_graphs import PinnedRing, graph_buckets
from pocketllm.runner.step_backend import HostBatchStep, ReferenceStep
from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.host_batch import HostBatch

logger = logging.getLogger("pocketllm.runner")

# The smallest context bucket: shorter contexts share one graph per batch bucket.
MIN_CONTEXT_BUCKET = 256
# Steps with a longer context run eagerly: their padded histories would hold a graph's memory (kept for the
# engine's life) of up to twice their entries, and their device time, not the launches, dominates them.
MAX_CONTEXT_BUCKET = 8192
# Segments of the static input buffer (each ``max_num_seqs`` rows, aligned): token ids, positions, KV slots,
# state slots; then the block tables.
_SEGMENTS = 4


def context_bucket(longest: int, max_model_len: int) -> int:
    """The context a graph of a step whose longest context is ``longest`` is captured for."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < longest:
        bucket *= 2
    return max(longest, min(bucket, max_model_len))


class ReferenceGraphStep(HostBatchStep):
    """The reference step with its plain decode steps replayed from CUDA graphs (``replay=False``: the padded
    static-input forward runs eagerly every step instead, which is how the tests check the padding on CPU)."""

    def __init__(self, reference: ReferenceStep, replay: bool = True) -> None:
        super().__init__(reference.block_size, reference.step_channel)
        self.reference = reference
        self.model = reference.model
        self.device = reference.device
        self.replay = replay
        self.buckets: list[int] = []     # empty until ``setup``: every step runs eagerly
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.kept_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.failed: set[tuple[int, int]] = set()   # buckets whose capture failed: their steps run eagerly
        self.decode_steps = 0    # plain decode steps run over the static inputs, replayed or not
        self.replays = 0         # of which replayed from a graph
        self.ring = PinnedRing() if self.device.type == "cuda" else None

    def setup(self, max_num_seqs: int, max_model_len: int) -> None:
        """The static inputs and logits for batches of up to ``max_num_seqs`` sequences of up to
        ``max_model_len`` tokens; graphs are captured as steps need them."""
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // self.block_size)
        self.segment = -(-max_num_seqs // 16) * 16
        self.static = torch.zeros(_SEGMENTS * self.segment + max_num_seqs * self.width, dtype=torch.int32,
                                  device=self.device)
        self.logits = torch.empty(max_num_seqs, self.model.lm_head.vocab_size, dtype=self.model.lm_head.logits_dtype,
                                  device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.replay else None
        self.buckets = graph_buckets(max_num_seqs)

    def run(self, host: HostBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        n = host.num_seqs
        if (self.buckets and host.is_plain_decode and n <= self.buckets[-1]
                and max(host.context_lens) <= MAX_CONTEXT_BUCKET and all(c < 0 for c in host.state_checkpoints)
                and max(len(t) for t in host.tables) <= self.width):
            key = next(b for b in self.buckets if b >= n), context_bucket(max(host.context_lens), self.max_model_len)
            if key not in self.failed:
                return self._decode(host, previous_tokens, key)
        return self.reference.run(host, previous_tokens)

    def _decode(self, host: HostBatch, previous_tokens: torch.Tensor | None, key: tuple[int, int]) -> torch.Tensor:
        """A plain decode step through the graph of its buckets ``key`` (captured now if it is the first such
        step)."""
        n, bs = host.num_seqs, key[0]
        self.decode_steps += 1
        self._send(host, bs)
        ids = self.static[:bs]
        host.pending.fill(ids[:n], previous_tokens)
        if bs > n:   # padding rows take row 0's token, which may have been pending until now
            ids[n:].copy_(ids[:1].expand(bs - n))
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            if key in self.kept_hidden:   # the MTP head reads this step's rows
                self.model.mtp_target_hidden = self.kept_hidden[key][:n]
        else:
            self._forward(*key)
            if self.replay:
                kept = getattr(self.model, "mtp_target_hidden", None)
                self._capture(*key)
                if kept is not None:   # this step's own rows, not the capture's (recorded, never computed)
                    self.model.mtp_target_hidden = kept[:n]
        return self.logits[:n]

    def _send(self, host: HostBatch, bs: int) -> None:
        """The host batch's rows, then ``bs - n`` copies of its row 0, into the static inputs."""
        n, seg, width = host.num_seqs, self.segment, self.width
        size = _SEGMENTS * seg + bs * width
        if self.ring is not None:
            turn, buf = self.ring.take(size)
        else:
            turn, buf = None, np.zeros(size, dtype=np.int32)
        state = host.state_slots or [0] * n
        for k, values in enumerate((host.input_ids, host.positions, host.slots, state)):
            buf[k * seg:k * seg + n] = values
            buf[k * seg + n:k * seg + bs] = values[0]
        # (Past a table's length a row keeps ids of earlier steps: only entries of its own context are read.)
        tables = buf[_SEGMENTS * seg:size].reshape(bs, width)
        for row, table in enumerate(host.tables):
            tables[row, :len(table)] = table
        tables[n:] = tables[0]
        if self.ring is not None:
            self.ring.send(turn, size, self.static)
        else:
            self.static[:size].copy_(torch.from_numpy(buf))

    def _forward(self, bs: int, context: int) -> None:
        """The model over the first ``bs`` static rows, its histories padded for ``context`` tokens, into the
        static logits (what a graph records)."""
        seg = self.segment
        ids, positions, slots, state = (self.static[k * seg:k * seg + bs].long() for k in range(_SEGMENTS))
        tables = self.static[_SEGMENTS * seg:_SEGMENTS * seg + bs * self.width].view(bs, self.width).long()
        # The host lists give the padding of the compressed histories (every context as the bucket's) and the
        # decode shape; the state slots' host copy is not read on a decode step.
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start=list(range(bs + 1)),
                                 context_lens=[context] * bs, block_size=self.block_size,
                                 state_slots=state if self.reference.has_state else None,
                                 state_slots_host=[0] * bs if self.reference.has_state else None)
        self.logits[:bs].copy_(self.model.compute_logits(self.model(ids, positions, meta)))

    def _capture(self, bs: int, context: int) -> None:
        """Record the graph of ``_forward(bs, context)``; where that fails (out of memory, say), the buckets' steps
        run eagerly from then on."""
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # (thread_local: a capture during serving does not fail on another thread's CUDA call)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward(bs, context)
        except RuntimeError as error:
            self.failed.add((bs, context))
            logger.warning("the decode CUDA graph of %d rows, histories padded for %d tokens, could not be "
                           "captured (%s): those steps run eagerly", bs, context, str(error).splitlines()[0])
            return
        self.graphs[bs, context] = graph
        kept = getattr(self.model, "mtp_target_hidden", None)
        if kept is not None:   # with an MTP head: the rows' hidden states the capture kept, rewritten by a replay
            self.kept_hidden[bs, context] = kept
        logger.info("captured the decode CUDA graph of %d rows, histories padded for %d tokens, in %.2f s",
                    bs, context, time.perf_counter() - started)
